"""The trainer's data feed: Megatron's GPTDataset over the corpus (the embedded one indexed on first
use), global-batch samplers, and each global batch as this rank's micro-batches -- sharded by
token, packed per document (--reset-attention-mask), or placed document by document
(--dynamic-ulysses)."""

from __future__ import annotations

import functools
import os
import socket

import torch.distributed as dist
from megatron.core import parallel_state as ps

from ulysses_mcore.validation.agreement import agree, digest
from ulysses_mcore.megatron.layer.batch import document_boundaries, pack_batch, reset_position_ids, shard_batch
from ulysses_mcore.megatron.trainer import data as D
from ulysses_mcore.megatron.trainer.arguments import corpus_dir
from ulysses_mcore.megatron.trainer.dynamic import DynamicBatches, bucket_of, costs_of


class DataFeed:
    """Megatron's GPTDataset over the corpus, global-batch samplers, and the sharding of a batch."""

    def __init__(self, args, groups=None):
        self.args, self.tok = args, D.ByteTokenizer()
        G = args.global_batch_size
        n_eval = (args.train_iters // args.eval_interval + 1) * args.eval_iters if args.eval_interval else 0
        build = functools.partial(
            D.build_gpt_datasets,
            seq_length=args.seq_length,
            seed=args.seed,
            split=args.split,
            samples=[args.train_iters * G, n_eval * G, 0],
            tokenizer=self.tok,
        )
        prefix = args.data_path or _embedded_corpus(args, self.tok, build)
        train_ds, valid_ds, _ = build(prefix)
        kw = dict(  # --dynamic-ulysses: every rank reads the whole global batch (and places it)
            global_batch_size=G,
            micro_batch_size=args.micro_batch_size,
            dp_size=1 if args.dynamic_ulysses else ps.get_data_parallel_world_size(),
            dp_rank=0 if args.dynamic_ulysses else ps.get_data_parallel_rank(),
        )
        self.sampler = D.GlobalBatchSampler(train_ds, **kw)
        self.vsampler = D.GlobalBatchSampler(valid_ds, **kw) if valid_ds is not None and n_eval else None
        # a packed micro-batch is one stream of micro-batch-size x seq-length tokens
        seq, mbs = args.seq_length, args.micro_batch_size
        self.sched = (
            dict(seq_length=seq * mbs, micro_batch_size=1)
            if args.reset_attention_mask
            else dict(seq_length=seq, micro_batch_size=mbs)
        )
        self.dynamic = _dynamic_batches(args, self.tok, groups) if groups is not None else None

    def shard(self, mbs):
        args = self.args
        if self.dynamic is not None:  # the global batch placed document by document (docs/dynamic.md)
            return self.dynamic.microbatches(mbs)
        if args.reset_attention_mask:  # one packed THD stream per micro-batch, documents split at EOD
            packed = [pack_batch(mb, self.tok.eod, reset_positions=args.reset_position_ids) for mb in mbs]
            _agree_on_boundaries(packed)
            return [shard_batch(mb) for mb in packed]
        if args.reset_position_ids:
            mbs = [reset_position_ids(mb, self.tok.eod) for mb in mbs]
        return [shard_batch(mb, load_balanced=True) for mb in mbs]

    def announce(self, consumed):
        args = self.args
        if args.reset_attention_mask and dist.get_rank() == 0:
            first = self.sampler.microbatches(consumed)
            n_docs = sum(len(document_boundaries(mb["tokens"], self.tok.eod)) - 1 for mb in first)
            print(
                f"[ulysses-mcore] --reset-attention-mask: each micro-batch is one packed THD stream of "
                f"{args.micro_batch_size} x {args.seq_length} tokens split at EOD (cu_seqlens, no [s, s] mask); "
                f"{n_docs} documents in rank 0's first {len(first)} micro-batches",
                flush=True,
            )


def _agree_on_boundaries(packed) -> None:
    """Once a step, the ranks that share a sequence (Megatron's context-parallel group: Ulysses x ring)
    agree on the document boundaries of its packed micro-batches (host tensors here: one all-reduce,
    no device read), so ranks that read different data stop with the same error instead of running
    attention over boundaries that differ (which no later call checks)."""
    group = ps.get_context_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    bounds = tuple(tuple(mb["cu_seqlens"].tolist()) for mb in packed)  # host tensors: no sync
    if not agree(digest(bounds), group):
        raise ValueError(
            "--reset-attention-mask: the ranks sharing a sequence (Ulysses x ring) read different documents "
            "(their packed boundaries differ); every rank must read the same data (the same --data-path, "
            "--split and --seed)"
        )


def _dynamic_batches(args, tok, groups):
    cap = args.micro_batch_size * args.seq_length // args.ulysses_degree
    return DynamicBatches(
        groups,
        cap=cap,
        costs=costs_of(args),
        bucket=bucket_of(args, cap),
        eod=tok.eod,
        reset_positions=args.reset_position_ids,
    )


def _embedded_corpus(args, tok, build) -> str:
    """The embedded corpus' indexed dataset and Megatron's index caches, made by each node's first
    rank in its own --log-dir (nodes need not share a folder); returns its prefix."""
    prefix = os.path.join(corpus_dir(args), "kjv")
    if int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0:
        if not os.path.exists(prefix + ".idx"):
            _index_embedded_corpus(prefix, tok)
        if dist.get_rank() != 0:  # global rank 0 builds its caches inside the builder's own collective call
            with D.as_one_process():
                build(prefix)
    dist.barrier()
    return prefix


def _index_embedded_corpus(prefix: str, tok) -> None:
    """The embedded corpus as an indexed dataset at ``prefix``, written under a name of this process's
    and renamed into place (.bin, then .idx): node leaders sharing a folder never see half a file."""
    tmp = f"{prefix}.tmp-{socket.gethostname()}-{os.getpid()}"
    D.write_indexed_dataset(D.read_documents(D.EMBEDDED_CORPUS), tmp, tok, progress=False)
    os.replace(tmp + ".bin", prefix + ".bin")
    os.replace(tmp + ".idx", prefix + ".idx")
