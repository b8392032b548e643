"""Data: a byte-level tokenizer, Megatron indexed datasets, GPTDataset, and a resumable sampler.

* :class:`ByteTokenizer` needs no download: UTF-8 bytes 0-255, ``eod`` 256, ``pad`` 257.
* :func:`write_indexed_dataset` writes Megatron's ``.bin``/``.idx`` with megatron-core's
  ``IndexedDatasetBuilder``.
* :func:`build_gpt_datasets` builds train/valid/test ``GPTDataset`` s through
  ``BlendedMegatronDatasetBuilder``.
* :class:`GlobalBatchSampler` maps ``consumed_samples`` to this data-parallel rank's
  micro-batches, so a resumed run reads exactly the samples an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Iterable, Iterator, List, Optional

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ulysses_mcore/
EMBEDDED_CORPUS = os.path.join(_PACKAGE, "corpus", "kjv_genesis_exodus.jsonl")


class ByteTokenizer:
    """UTF-8 bytes as tokens; what Megatron's GPTDataset asks of a tokenizer."""

    def __init__(self):
        self.eod = 256
        self.pad = 257
        self.vocab_size = 258
        self.unique_identifiers = {"class": "ByteTokenizer", "vocab_size": 258}

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def read_documents(path: str, json_key: str = "text") -> Iterator[str]:
    """Documents of a ``.jsonl`` (one JSON object a line, text under ``json_key``) or a plain
    text file (documents separated by blank lines)."""
    if path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON line ({e.msg}); expected one object per line") from None
                if json_key not in obj:
                    raise ValueError(f"{path}:{n}: no key {json_key!r} (keys: {sorted(obj)}); pass --json-keys")
                yield obj[json_key]
    else:
        with open(path, encoding="utf-8") as f:
            for doc in f.read().split("\n\n"):
                if doc.strip():
                    yield doc.strip()


def write_indexed_dataset(
    docs: Iterable[str], output_prefix: str, tokenizer=None, *, progress: bool = True, total: Optional[int] = None
) -> dict:
    """Tokenize ``docs`` (EOD appended) into ``output_prefix.bin/.idx``; returns counts."""
    tok = tokenizer or ByteTokenizer()
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(output_prefix + ".bin", dtype=np.uint16)
    n_docs = n_tokens = 0
    t0 = time.time()
    for doc in docs:
        ids = tok.tokenize(doc) + [tok.eod]
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
        n_docs += 1
        n_tokens += len(ids)
        if progress and (n_docs % 10 == 0 or n_docs == total):
            frac = f"{n_docs}/{total}" if total else str(n_docs)
            bar = ""
            if total:
                done = int(30 * n_docs / total)
                bar = "[" + "#" * done + "." * (30 - done) + "] "
            rate = n_tokens / max(time.time() - t0, 1e-9) / 1e6
            print(f"\r{bar}{frac} documents, {n_tokens} tokens ({rate:.2f} M tokens/s)", end="", file=sys.stderr)
    builder.finalize(output_prefix + ".idx")
    if progress:
        print(file=sys.stderr)
    return {"documents": n_docs, "tokens": n_tokens, "prefix": output_prefix}


def check_indexed_dataset(prefix: str) -> int:
    """Raise a clear error for a missing, corrupt or truncated ``.bin/.idx`` pair; return tokens."""
    fix = f"re-create it with ulysses-mcore preprocess --input FILE --output-prefix {prefix}"
    for ext in (".bin", ".idx"):
        if not os.path.exists(prefix + ext):
            raise FileNotFoundError(f"--data-path {prefix}: {prefix + ext} is missing; {fix}")
    try:
        ds = IndexedDataset(prefix, mmap=False)
        lengths = ds.index.sequence_lengths
        pointers = ds.index.sequence_pointers
        itemsize = np.dtype(ds.index.dtype).itemsize
    except Exception as e:  # a corrupt index: bad magic, version or sizes
        raise ValueError(
            f"--data-path {prefix}: {prefix}.idx is not a valid Megatron index ({type(e).__name__}: {e}); {fix}"
        ) from None
    if len(lengths) == 0:
        raise ValueError(f"--data-path {prefix}: the dataset holds no documents; {fix}")
    need = int(pointers[-1]) + int(lengths[-1]) * itemsize
    have = os.path.getsize(prefix + ".bin")
    if have < need:
        raise ValueError(
            f"--data-path {prefix}: {prefix}.bin is truncated ({have} bytes, the index needs {need}); {fix}"
        )
    return int(np.sum(lengths))


SPLITS = ("train", "validation", "test")


def split_documents(n_docs: int, split: str):
    """Documents in each split of ``n_docs`` under ``--split`` as Megatron's dataset builder cuts them
    (its own normalisation and split matrix; each bound rounded to a whole document); ``None`` for a
    split of weight 0 (not built)."""
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [None if b is None else int(round(b[1] * n_docs)) - int(round(b[0] * n_docs)) for b in matrix]


def split_problem(prefix: str, split: str) -> str:
    """Why ``--split`` cannot cut this dataset ("" if it can): a split of non-zero weight that gets no
    document -- Megatron's builder builds it anyway and loops forever looking for its first epoch."""
    n_docs = len(IndexedDataset(prefix, mmap=True).document_indices) - 1  # mapped: read where needed
    counts = split_documents(n_docs, split)
    empty = [name for name, docs in zip(SPLITS, counts) if docs == 0]
    if not empty:
        return ""
    fitting = ",".join("0" if c is None else "1" for c in counts[1:])
    return (
        f"--split {split} leaves the {' and '.join(empty)} split(s) with none of the {n_docs} documents in "
        f"--data-path {prefix} (documents per split: {[c or 0 for c in counts]}; Megatron's builder would wait "
        f"forever for them): give every split a share of at least one document (e.g. --split "
        f"{max(1, n_docs - fitting.count('1'))},{fitting}), give the empty ones weight 0 (e.g. --split 100,0,0), "
        "or add documents"
    )


@contextlib.contextmanager
def as_one_process():
    """Inside, ``torch.distributed`` reports itself uninitialised, so Megatron's dataset builder
    builds (and saves) its index caches in this process alone, as in a world of one.  For a node's
    first rank when nodes share no folder (the builder otherwise writes caches on global rank 0
    only, and the other ranks read them); no collective may run inside."""
    saved = torch.distributed.is_initialized
    torch.distributed.is_initialized = lambda: False
    try:
        yield
    finally:
        torch.distributed.is_initialized = saved


def build_gpt_datasets(
    prefix: str, *, seq_length: int, seed: int, split: str, samples, tokenizer=None, cache_dir: Optional[str] = None
):
    """(train, valid, test) GPTDatasets over one indexed dataset, via BlendedMegatronDatasetBuilder."""
    check_indexed_dataset(prefix)
    problem = split_problem(prefix, split)
    if problem:
        raise ValueError(problem)
    cfg = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split=split,
        tokenizer=tokenizer or ByteTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=cache_dir,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, samples, lambda: True, cfg).build()


class GlobalBatchSampler:
    """Global batch ``i`` is samples ``[c, c + G)`` with ``c = consumed_samples``; data-parallel
    rank ``d`` takes its ``G / dp`` of them, as ``G / (dp * mbs)`` micro-batches of ``mbs``."""

    def __init__(self, dataset, *, global_batch_size: int, micro_batch_size: int, dp_size: int, dp_rank: int):
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(
                f"--global-batch-size {global_batch_size} must be a multiple of --micro-batch-size "
                f"{micro_batch_size} x data-parallel size {dp_size}"
            )
        self.dataset, self.G, self.mbs, self.dp, self.rank = (
            dataset,
            global_batch_size,
            micro_batch_size,
            dp_size,
            dp_rank,
        )

    def microbatches(self, consumed_samples: int) -> List[dict]:
        per_rank = self.G // self.dp
        start = consumed_samples + self.rank * per_rank
        idx = [(start + i) % len(self.dataset) for i in range(per_rank)]
        out = []
        for m in range(0, per_rank, self.mbs):
            samples = [self.dataset[i] for i in idx[m : m + self.mbs]]
            out.append(
                {
                    k: torch.stack([torch.as_tensor(s[k]) for s in samples])
                    for k in ("tokens", "labels", "loss_mask", "position_ids")
                }
            )
        return out
