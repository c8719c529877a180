"""One process's place in a tensor-parallel group, on torch.distributed.

A model loaded with `tp=N` holds 1/N of the attention heads (and output groups) and of the routed
experts of every layer; each rank computes its part of a layer's output and `all_reduce_sum` adds
the N parts. Everything else (embedding, mHC streams, norms, compressors, indexers, KV state,
lm_head) is replicated.

Why the sum is an all-gather followed by a local sum in rank order, not `dist.all_reduce`: every
rank then adds the same N tensors in the same order with the same elementwise IEEE additions, so
every rank holds the same bits by construction (replicated state stays bit-identical across
ranks), and the order does not depend on which algorithm the backend picks for a collective. It
moves N times the bytes of a ring all-reduce, which at the sizes of one decode step is latency,
not bandwidth.

A peer that dies or hangs makes the next collective fail after the group's timeout
(`init_process_group(timeout=...)`); `all_reduce_sum` and `broadcast_objects` turn that into a
`TensorParallelError` naming the rank and the timeout, so no rank waits forever.
"""
from __future__ import annotations

import datetime

import torch

from ..errors import ConfigError, KvfoldError


class TensorParallelError(KvfoldError):
    """A collective of the tensor-parallel group failed: a peer died, hung past the timeout or left."""


def check_divides(what: dict[str, int], size: int) -> None:
    """ConfigError, before anything is loaded, unless `size` divides every count in `what`; the
    message lists the sizes that would."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"tp must be an int >= 1, got {size!r}")
    bad = {k: v for k, v in what.items() if v % size}
    if bad:
        common = [d for d in range(1, max(what.values()) + 1) if all(v % d == 0 for v in what.values())]
        raise ConfigError(f"tp={size} does not divide " + ", ".join(f"{k} ({v})" for k, v in bad.items())
                          + f"; tensor parallelism over this config needs tp in {common}")


def local_expert(expert: int, n_experts: int, tp) -> int | None:
    """This rank's index of routed expert `expert` of `n_experts` (contiguous ranges per rank),
    None when another rank holds it; the expert itself without tensor parallelism."""
    if tp is None:
        return expert
    lo, hi = tp.span(n_experts)
    return expert - lo if lo <= expert < hi else None


def skips_shared_expert(name: str, tp) -> bool:
    """Whether this rank leaves out tensor `name` because it is the shared expert's, held by rank 0."""
    return tp is not None and tp.rank != 0 and ".mlp.shared_experts." in name


class TensorParallel:
    """rank, size and the collectives the sharded layers use (module docstring)."""

    def __init__(self, rank: int, size: int, group=None):
        self.rank, self.size, self.group = rank, size, group
        self.reduced_bytes = 0  # bytes of the tensors summed so far (each rank's payload)

    @classmethod
    def current(cls, size: int) -> "TensorParallel":
        """This process's place in the default process group, which must have `size` ranks."""
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(f"tp={size} needs a torch.distributed process group: start the ranks with torchrun "
                              f"(torchrun --nproc-per-node {size} -m kvfold ...) or call "
                              f"torch.distributed.init_process_group first")
        if dist.get_world_size() != size:
            raise ConfigError(f"tp={size} but the process group has {dist.get_world_size()} ranks; start "
                              f"{size} ranks or pass tp={dist.get_world_size()}")
        return cls(dist.get_rank(), size)

    def span(self, n: int) -> tuple[int, int]:
        """This rank's contiguous share [lo, hi) of n items (n divisible by size)."""
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, the same bits on every rank (module docstring)."""
        if self.size == 1:
            return x
        self.reduced_bytes += x.nbytes
        parts = self.gather(x)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (equal shapes), in rank order, on every rank."""
        if self.size == 1:
            return [x]
        import torch.distributed as dist
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        try:
            dist.all_gather(parts, x, group=self.group)
        except RuntimeError as exc:
            raise self._failed("all-gather", exc) from None
        return parts

    def broadcast_objects(self, obj):
        """Rank 0's `obj` (picklable: chosen token ids, the engine's step log) on every rank. Pickled
        between the ranks of this one program's process group, never from outside it."""
        if self.size == 1:
            return obj
        import torch.distributed as dist
        box = [obj if self.rank == 0 else None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except RuntimeError as exc:
            raise self._failed("broadcast", exc) from None
        return box[0]

    def _failed(self, what: str, exc: Exception) -> TensorParallelError:
        return TensorParallelError(f"tensor-parallel {what} failed on rank {self.rank} of {self.size} (a peer died, "
                                   f"hung past the process group's timeout or left): {exc}")


def default_timeout() -> datetime.timedelta:
    """The process-group timeout kvfold's launchers use: a dead peer ends the group within it."""
    return datetime.timedelta(seconds=120)


def join_group(size: int, device: str) -> None:
    """Join the process group of a `torchrun --nproc-per-node N -m kvfold ... --tp N` launch (its
    env:// rendezvous, multi-node included), unless the process already belongs to one: gloo on the
    CPU, NCCL on CUDA, with `default_timeout()`."""
    import os

    import torch.distributed as dist
    if size == 1 or (dist.is_available() and dist.is_initialized()):
        return
    if "WORLD_SIZE" not in os.environ:
        raise ConfigError(f"--tp {size} runs one process per rank: start it as torchrun --nproc-per-node {size} "
                          f"-m kvfold ... --tp {size} (add torchrun's --nnodes/--node-rank/--rdzv-endpoint "
                          f"arguments for several machines)")
    cuda = str(device).startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=default_timeout())


def leave_group(clean: bool = True) -> None:
    """Leave the process group `join_group` joined, if any, before the process exits: a gloo group
    still alive at interpreter exit can abort the process ("terminate called without an active
    exception") while its peer closes its side. After a clean run the ranks first meet at a
    barrier, so none tears down its connections while another still uses them (a peer that has
    already gone, as after a Ctrl-C that reached every rank, fails the barrier, which is then
    skipped); after an error the group is destroyed at once."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return
    if clean:
        try:
            dist.barrier()
        except RuntimeError:  # gloo's DistBackendError: the peer closed its side first
            pass
    dist.destroy_process_group()
