"""Latency of every path at every M, against the strongest alternatives measured in the same run.

Run one process per GPU: ``torchrun --nproc-per-node N -m lamport_mhc bench`` (or ``torchrun
--nproc-per-node N bench/run.py``; N = 1 works). Every path runs ``--calls`` times inside one CUDA
graph; a replay's time / calls is one sample, the max over ranks of each replay is taken, and the
median (min, max) over ``--replays`` is reported. The paths of one (hidden, variant, M) are captured
first and then replayed in turns, every graph once a turn (``timing.GraphTimer``): what drifts over
the row's seconds (clocks, temperature) falls on every path alike. Each timed replay follows an
untimed one of the same graph, so a path's timed calls follow its own, not the path before it. The
unfused paths' torch tails are replayed in turns of their own, after the others': among them they
slowed the fused paths even so (``timing``). In the same run:

- the fused paths: ``auto`` and, per ``--backends``, LL and BT forced (``<backend>-ll``,
  ``<backend>-bt``); on one GPU the one protocol there is, ``<backend>-local``;
- ``strong-tail``: the unfused tail as one bandwidth-bound Triton kernel (post-mix, collapse,
  RMSNorm, the MXFP8 copy for quant; finalize: a bandwidth-bound MoE-finalize kernel first), alone,
  reported against the device-copy ceiling on its own bytes;
- the all-reduces alone: NCCL, PyTorch symmetric memory's ``one_shot_all_reduce`` and
  ``two_shot_all_reduce``, FlashInfer's TRT-LLM Lamport all-reduce (``flashinfer_all_reduce``) and
  vLLM's custom all-reduce (``vllm_custom_all_reduce``);
- ``unfused-best``: the fastest of those all-reduces at each M, then the strong kernels, as one
  graph (one GPU: the strong kernels alone); ``unfused-nccl`` / ``unfused-one-shot``: NCCL or
  one-shot, then the tail in compiled torch ops (the baseline of earlier results);
- ``tilekernels-tail``: DeepSeek's tile-kernels (``mhc_post``, ``mhc_pre_apply_mix``; finalize: its
  ``moe.reduce_fused`` first), then the strong tail's RMSNorm (and MXFP8 copy), after the fastest
  all-reduce as unfused-best, each shape's outputs checked against the reference before it is timed
  (hc = 4 only; ``pip install 'lamport-mhc[tilekernels]'``);
- with ``--hc 1`` (post = comb = pre = 1, where the op is all-reduce + residual add + RMSNorm):
  FlashInfer's fused kernels ``flashinfer-fusion-oneshot`` / ``-twoshot`` (finalize: its MoE-finalize
  fusion);
- ``lamport-ar-floor``, the simplest one-kernel Lamport all-reduce, and two ceilings (peer copy over
  NVLink, device copy in HBM) from which every fused row gets its byte floor.

Peers that cannot run here (not installed, a group size they refuse, a failed build) are reported
as skipped. Outputs under ``--out`` (default bench/results): ``<gpu>_tp<N>.csv`` (with
``speedup_vs_best``: the fastest alternative that does the whole op over the row), a PNG per (hc,
hidden, variant) when matplotlib is installed (``pip install 'lamport-mhc[bench]'``),
``<gpu>_tp<N>.md`` and the notes as ``<gpu>_tp<N>_notes.json``. ``--paths`` times a subset of the
paths; ``--merge CSV`` extends an earlier run: its rows and notes are kept except those this run
measured again (a run of other ``--rows`` than the sweep's scopes its notes to them, so that they
stand beside the full run's); ``--time-budget SECONDS`` starts no new M after that long and writes what it has.
A hidden size that fails (a GPU fault) writes the rows measured before it too, then the run stops.
"""

from .cli import main, parse_args
from .floors import Ceilings, floor_us, fused_bytes, tail_bytes
from .names import DEFAULT_ROWS, HC, PATHS, VARIANTS
from .report import COLUMNS, read_rows, with_speedups, write_results, write_summary

__all__ = ["COLUMNS", "DEFAULT_ROWS", "HC", "PATHS", "VARIANTS", "Ceilings", "floor_us", "fused_bytes", "main",
           "parse_args", "read_rows", "tail_bytes", "with_speedups", "write_results", "write_summary"]
