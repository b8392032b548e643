"""Text or JSONL -> Megatron's indexed dataset (.bin/.idx), byte-level tokens, no download.

    ulysses-mcore preprocess --input corpus.jsonl --output-prefix data/corpus [--json-keys text]

A ``.jsonl``/``.json`` input has one JSON object a line (text under ``--json-keys``); any
other file is plain text with documents separated by blank lines.  Each document gets an
end-of-document token.  Shows a progress bar on stderr.
"""

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="a .jsonl / .json file (one object a line) or plain text")
    p.add_argument(
        "--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx (pass PREFIX as --data-path)"
    )
    p.add_argument(
        "--json-keys", default="text", help="the JSON field holding a document's text (default: %(default)s)"
    )
    p.add_argument(
        "--tokenizer-type", default="ByteTokenizer", choices=["ByteTokenizer"], help="byte-level tokens (the only one)"
    )
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    # Megatron's datasets (1.7 s of start-up) only once the flags parse
    from ulysses_mcore.megatron.trainer.data import read_documents, write_indexed_dataset

    if not os.path.exists(a.input):
        print(f"error: --input {a.input} does not exist", file=sys.stderr)
        return 2
    total = None
    if a.input.endswith((".jsonl", ".json")):
        with open(a.input, encoding="utf-8") as f:
            total = sum(1 for line in f if line.strip())
    stats = write_indexed_dataset(read_documents(a.input, a.json_keys), a.output_prefix, total=total)
    print(f"wrote {stats['prefix']}.bin/.idx: {stats['documents']} documents, {stats['tokens']} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
