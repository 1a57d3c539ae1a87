"""The Triton backend: builds the kernel plan of a spec over a workspace and launches it.

On a GPU the kernels are compiled at construction (``warmup``) with fp fusion off, PDL on sm_90+.
With ``interpret=True`` the same kernel bodies run under the Triton interpreter on host buffers
(``ON_GPU=False`` selects the interpreter twins of the PTX helpers): the simulated TP group.
"""

from __future__ import annotations

import math

import torch

from lamport_mhc.backend import BuildSpec, ConsumerArgs, Support, cuda_device_support, symmetric_memory_support
from lamport_mhc.call import Call
from lamport_mhc.carveout import pin_build
from lamport_mhc.presets import device_keys
from lamport_mhc.traffic import STREAMED_ROWS, streams_past_l2
from lamport_mhc.workspace import Workspace

from .interpret import launch_interpreted
from .launch_shape import set_launch_shape, set_launch_shared_bytes
from .consumer import ALL_PHASES, MIX_PHASE, NORMALIZE_PHASE, PUBLISH_PHASE
from .plan import (HELD_MIN_ROWS, VARIANT_CODES, cooperative_split, four_chunk_wide, kernel_plan, row_chunks,
                   wide_takes_many_rows)
from .spread import Spread, choose, measure_spreads

PHASE_CODES = {"publish": PUBLISH_PHASE.value, "consume": MIX_PHASE.value | NORMALIZE_PHASE.value,
               "both": ALL_PHASES.value}

MIN_CAPABILITY = (9, 0)  # griddepcontrol (PDL) and multimem.st

# The cooperative form while its programs fit one wave of 7 programs per SM (the local ones' capped
# twins take the calls past what the uncapped form holds: ``plan.LOCAL_COOPERATIVE_MAX_REGISTERS``).
# On one H200 (tp = 1, clusters) it beat the streaming form up to 128 rows at H = 5120 and 7168
# (plain 5.3 / 7.4 us against 7.1 / 9.1) and lost at 256 (9.3 / 11.7 against 8.3 / 10.6), but for
# the finalize at H = 7168 (16.8 against 19.4 us).
COOPERATIVE_PROGRAMS_PER_SM = 7


# The local calls of x take the cooperative form in these windows of rows per SM (above, at most),
# by the row's chunks and the variant (others: ``COOPERATIVE_PROGRAMS_PER_SM``); outside them the
# streaming form those calls take (``LOCAL_X_WIDE_ROWS_PER_SM``) is faster: from one row per SM the
# wide twin (one program per SM), and from a second program per SM again the cooperative form, for a
# while. One H200, tp = 1, CUDA graphs, the cluster exchange on mbarriers, us cooperative (or its
# capped twin past its resident clusters) / streaming: H = 4096 plain M = 100 / 128 / 160 3.39 /
# 3.46, 4.33 / 3.67, 4.40 / 4.48 (wide), quant 3.78 / 4.06, 4.79 / 4.27, 5.07 / 5.41; H = 5120 plain
# M = 160 / 192 / 224 5.64 / 5.87, 5.78 / 5.98, 6.62 / 6.08 (parked), quant 6.24 / 6.67, 6.69 / 6.90,
# 7.45 / 6.95; H = 7168 plain M = 100 / 112 / 128 / 160 4.71 / 5.44, 5.84 / 5.44, 6.25 / 5.55, 7.12 /
# 7.75 (wide), quant 5.27 / 6.45, 6.72 / 6.50, 6.68 / 6.12 (the four-chunk wide twin), 8.07 / 8.88
# (parked); in two more runs at M = 160 every cooperative form was faster by 0.16-1.06 us. (H = 5120,
# a second run: M = 192 plain 5.81 / 6.00, quant 6.69 / 6.82.)
# With the uncapped form past its resident clusters (``LOCAL_X_CAPPED_MIN_ROWS_PER_SM``), a second
# run: H = 4096 M = 176 / 192 quant 5.01 / 5.41 (wide), 5.80 / 5.42, plain 4.40 / 4.44, 5.15 / 4.45;
# H = 7168 M = 105 / 112 / 128 quant 6.09 / 6.38 (wide), 6.46 / 6.56, 6.71 / 6.23, plain 5.52 / 5.43,
# 5.71 / 5.41; M = 176 / 192 / 224 quant 8.21 / 8.80 (parked), 8.71 / 8.93, 9.88 / 9.10, plain 7.34
# / 7.59 (wide), 7.85 / 7.79. H = 7168 quant, later kernels, past the 101 clusters resident (two rounds
# each but the last): one H200 M = 112 6.37-6.40 against 5.60-5.74 (the wide twin, hinted); one H100
# M = 104 / 108 / 110 6.16-6.29, 6.45, 6.48-6.58 against 5.70-5.75, 5.76-5.92, 5.79-5.84, but M = 100
# 5.10-5.22 against 5.81-5.83; one H200, one round, M = 101 / 104 / 108 5.23 / 5.67, 6.07 / 5.67,
# 6.25 / 5.60: at 7168 it takes the calls up to its resident clusters only (plain too: M = 105 above).
# H = 5120 plain, later kernels, one H200, two rounds, us cooperative / the wide twin: M = 64 2.78 /
# 3.65, 100 4.07-4.15 / 3.74-3.85, 128 4.08-4.14 / 3.88-3.92 (strong 3.88-3.97, 4.08-4.10): the wide
# twin takes the calls above 0.7 rows per SM to one (``LOCAL_X_WIDE_ROWS_PER_SM``), the edge the H100
# measured (M = 72-88 below: ``MODEL_WINDOWS``); no H200 has timed M = 65-99.
LOCAL_X_COOPERATIVE_ROWS_PER_SM = {(4, "plain"): ((0, 0.85), (1, 1.25)), (4, "quant"): ((0, 0.85), (1, 1.35)),
                                   (5, "plain"): ((0, 0.7), (1, 1.5)), (5, "quant"): ((0, 1.5),),
                                   (7, "plain"): ((0, 0.77), (1, 1.35)), (7, "quant"): ((0, 0.77), (1, 1.5))}

# The local calls of x take the cooperative form's capped twin, past the uncapped one's resident
# clusters, only from these rows per SM, by the row's chunks where measured (inf: never); a second
# wave of the uncapped form mostly beat one of the capped. One H200, tp = 1, us uncapped / capped:
# H = 5120 (146 / 193 clusters resident) M = 160 / 192 plain 5.70 / 5.79, 6.35 / 5.99, quant 6.41 /
# 6.79, 7.11 / 6.96; H = 7168 (101 / 139) M = 105 / 112 / 160 / 176 plain 5.52 / 5.85, 5.71 / 5.81,
# 7.05 / 7.17, 7.34 / 7.46, quant 6.09 / 6.66, 6.46 / 6.86, 7.84 / 8.09, 8.21 / 8.40.
LOCAL_X_CAPPED_MIN_ROWS_PER_SM = {5: 1.4, 7: math.inf}

# The local finalize takes the cooperative form up to these rows per SM, by the row's chunks (others
# and calls with a mailbox: ``COOPERATIVE_PROGRAMS_PER_SM``). One H200, tp = 1, two runs, us
# cooperative / the wide twin the calls took at 7 programs per SM: H = 5120 M = 192 / 224 / 256 7.38
# / 8.82, 9.50 / 9.54, 10.41 / 10.39; H = 7168 M = 160 / 192 / 224 / 256 9.24 / 11.27, 11.15 / 12.42,
# 14.27 / 15.11, 18.55 / 17.06 (hinted). H = 4096, us cooperative / wide: M = 160 / 176 5.49 / 6.46,
# 5.54 / 6.57; M = 192 / 224 6.93 / 6.72 and 6.78 / 6.59, 7.03 / 7.05 and 6.94 / 6.68.
LOCAL_FINALIZE_COOPERATIVE_ROWS_PER_SM = {4: 1.4, 5: 1.75, 7: 1.75}

# The tightest cap on CTAs per SM a cooperative local launch spreads to (``spread``). On one H200
# the spread lost at H 4096, M 64 (plain 3.7 us against 3.4 unspread, quant 4.1 against 3.8); a
# floor of 3 or 5 CTAs per SM did not win those back (3.7 / 3.9 and 4.1 / 4.4) and 5 lost elsewhere.
SPREAD_MIN_CTAS_PER_SM = 1

# Local streaming calls take the ``_wide`` twins (chunks twice as wide, twice the warps), where the
# plan has them, when they have at most WIDE_ROWS_PER_SM rows per SM (their 4-warp programs would
# leave an SM 8 warps or fewer) and, where the wide chunks tile the row, from a full wave of wide
# programs (TILED_WIDE_MIN_ROWS_PER_SM: 4 of 8 warps at 64 registers), before the held twins. One
# H200, tp = 1, us wide / not: H 7168 M 192 / 256 plain 7.6 / 8.3, 9.0 / 10.5, finalize 11.0 / 12.9,
# 15.7 / 19.4; H 5120 M 256 plain 6.5 / 7.4, finalize 9.2 / 10.5; H 4096 M 256 / 1024 / 2048 / 4096 /
# 8192 quant 6.1 / 6.3, 24.6 / 25.3, 47.7 / 49.4, 91.2 / 93.9, 177.2 / 185.4 (held), plain 8192 165.0 /
# 168.7 (held). Between them wide lost: H 4096 M 384 quant 9.5 / 7.9, finalize 14.6 / 11.3 (M 512
# 16.2 / 15.7); H 7168 M 384 plain 17.4 / 16.7, finalize 23.9 / 21.6.
WIDE_ROWS_PER_SM = 2
TILED_WIDE_MIN_ROWS_PER_SM = 4
# The quant variant's four-chunk twin (``plan.wide_chunk``: 16 warps, 2 programs per SM) only takes
# calls of many rows, from 4.25 rows per SM (561 on 132 SMs): one H200 measured it slower at 528 rows
# and faster from 576, and no faster at few (M = 256 / 264: 10.4 / 10.4, 11.2 / 9.7 us).
FOUR_CHUNK_WIDE_MIN_ROWS_PER_SM = 4.25

# The local calls of x take the wide twins at the rows per SM measured for their row's chunks and
# variant (at most, at least; the second only where the wide twin takes the calls of many rows),
# where the windows above hold other calls. One H200, tp = 1, CUDA graphs, us wide / parked, two
# runs: H = 4096 plain M = 448 / 512 7.42 / 8.02, 9.08 / 9.65 and 9.16 / 9.54 (but M = 384 7.18 /
# 6.70), quant 9.53 / 9.83, 10.94 / 11.11; H = 5120 plain (three chunks of 2048, the last half
# masked) M = 224 / 256 6.36 / 6.08, 6.27 / 6.38 and 6.33 / 6.21: the wide twin only to one row per
# SM (M = 100 / 128 above, ``LOCAL_X_COOPERATIVE_ROWS_PER_SM``); H = 7168
# quant's four-chunk twin (16 warps) while an SM holds one: M = 128 / 132 6.12 / 6.68, 6.76 / 7.01
# against the capped cooperative form, and 6.15 / 6.74, but M = 160 10.66 / 8.88 (parked). H = 5120
# and 7168 plain from 5.5 rows per SM (one wave of 8 parked programs per SM is still faster), us
# parked / wide, both hinted: H = 7168 M = 576 / 608 / 640 / 672 / 704 25.68 / 26.69, 26.78 / 29.61,
# 27.76 / 30.05 (27.84 / 29.92 and 27.82 / 30.12 in two more runs), 28.92 / 30.22, 29.63 / 30.35; M =
# 768 / 896 / 1024 / 1536 31.86 / 31.17, 35.98 / 36.04, 39.52 / 40.15, 62.39 / 59.23; H = 5120 M =
# 576 / 640 / 704 17.86 / 19.18, 19.04 / 19.90 (19.05 / 19.87), 20.87 / 20.98; M = 768 / 1024 / 1536
# 23.09 / 22.64 (22.58 / 22.34), 28.10 / 28.71, 43.18 / 42.49.
# H = 7168 quant, a second wave of the four-chunk twin at 1.5-2 rows per SM (the cooperative form takes
# the calls between 1 and 1.5): M = 256, two runs, 9.51 / 10.21 and 9.81 / 10.65 (parked).
LOCAL_X_WIDE_ROWS_PER_SM = {(4, "plain"): (2, 3), (4, "quant"): (2, 3), (5, "plain"): (1, 5.5), (7, "plain"): (2, 5.5),
                            (7, "quant"): (2, FOUR_CHUNK_WIDE_MIN_ROWS_PER_SM)}

# The local calls of x take the held twin, where the plan has one, also in these windows of rows per
# SM (above, at most), by the row's chunks and variant: at H = 5120 quant while one wave of held
# programs (5 per SM) holds the call. One H200, tp = 1, us held / parked (hinted): M = 576 / 608 /
# 640 18.45 / 21.05, 19.12 / 21.70, 19.52 / 22.81 (19.62 / 22.60 in another run); but M = 512 /
# 672 16.92 / 14.62, 27.49 / 24.01.
LOCAL_X_HELD_ROWS_PER_SM = {(5, "quant"): ((4.25, 5),)}

# The local calls of x take the ``_broad`` twin (``plan.broad_chunk``) in these windows of rows per
# SM (above, at most), by the row's chunks and variant, before any other form. One H200, tp = 1,
# CUDA graphs, two runs, us broad / the form the calls took before (H = 7168 plain): M = 128 5.19 /
# 5.34 (wide), 1536 57.4 / 59.4 (wide, hinted), 2048 74.8 / 76.9 (wide); but M = 160 / 192 / 256
# 7.8 / 6.9 (cooperative), 7.9 / 7.5, 8.2-8.4 / 8.1 (wide), and 1000 / 1024 39.0 / 38.6, 39.7 / 39.4
# (parked, hinted). At H = 4096 (one chunk of 4096) it lost at every M from 64 to 2048 (plain M = 128
# 3.77-3.83 against 3.64, the wide twin hinted), as did the quant variant at 7168 (M = 128 6.10-6.28
# against 5.91): neither has the twin. With the cache hints it lost: M = 1536 58.4 / 58.6 against
# 57.4 / 57.4 unhinted, 2048 78.2 / 78.6 against 74.6 / 75.0; it has no hinted twin.
LOCAL_X_BROAD_ROWS_PER_SM = {(7, "plain"): ((0.85, 1.0), (11, 16))}

# The local calls of x take the ``_broad_held`` twin (``plan.broad_held_chunk``) in these windows of
# rows per SM (above, at most), by the row's chunks and variant, before any other form, and its
# hinted twin in the second table's. The twin is built in the shape of the strong tail's wide form,
# the fastest kernel of the benchmark at about one row per SM. One H200, tp = 1, two runs of
# ``bench/local_forms.py`` (the second the mean of two rounds), us: H = 7168 quant M = 128 hinted
# 5.46 / 5.38 against 5.99 / 5.82 for the hinted wide twin the calls took (the strong tail's wide
# form 5.82 / 5.58); but M = 100 5.56 against 5.24 (cooperative), 160 9.47 against 7.60. At H = 4096
# plain and quant and 5120 plain M = 100-128 it was no faster than the form the calls take (4096
# quant M = 128 3.97 / 3.93 against 4.05 / 3.86). A third run, two rounds: M = 112 / 128 / 132 hinted
# 5.46 / 5.42, 5.32 (auto) / 5.32, 5.55 / 5.53 against the strong tail's 5.44-5.47, 5.57-5.60,
# 5.87-5.94 (the calls of 112 rows, outside the window then, took a form at 6.37-6.40).
LOCAL_X_BROAD_HELD_ROWS_PER_SM: dict[tuple[int, str], tuple[tuple[float, float], ...]] = {}
LOCAL_X_HINTED_BROAD_HELD_ROWS_PER_SM = {(7, "quant"): ((0.84, 1.0),)}

# The local calls of x take the parked form in these windows of rows per SM (above, at most), by the
# row's chunks and variant, where the wide twin's window would take them. One H200, tp = 1, two runs,
# us parked / wide, both hinted at M = 1000 / 1024: H = 4096 plain 21.7 / 22.0, 22.3 / 22.8; H =
# 5120 28.0 / 28.6 (the wide twin's last chunk half masked), 28.0 / 29.0; H = 7168 38.6 / 39.4,
# 39.4 / 40.1. M = 2048 at H = 5120, unhinted: 54.0 / 56.3. But M = 1536 (hinted) H = 4096 35.7 /
# 34.5 (33.8 unhinted), 5120 43.1 / 42.9, and M = 2048 at 4096 44.2 / 44.1.
LOCAL_X_PARKED_ROWS_PER_SM = {(4, "plain"): ((7, 8),), (5, "plain"): ((7, 8), (12, 16)), (7, "plain"): ((7, 8),)}

# The local calls of x that take the wide twin with at most this many rows per SM (its few-rows
# window, by the row's chunks and variant) take its hinted twin, whatever their bytes. One H200,
# tp = 1, two runs, us hinted / not: H = 4096 quant M = 128 / 192 / 256 4.14 / 4.21, 5.60 / 5.63,
# 5.64 / 5.64; H = 7168 quant M = 128 5.91 / 6.13, but 256 9.91 / 9.60 and plain 256 8.7 / 8.1. H =
# 4096 plain took the hinted twin too (M = 128 / 192 / 256 3.64 / 3.71, 4.64 / 4.74, 4.84 / 5.00)
# until its loads of x and gamma as words and its roots table's butterfly: then 3.66 / 3.48, 4.74 /
# 4.51 (M = 128 / 256), and 3.51 / 3.50, 4.24 / 4.10, 4.61 / 4.42 in a second run.
LOCAL_X_HINTED_WIDE_ROWS_PER_SM = {(4, "quant"): 2, (7, "quant"): 1}

# The windows above were measured on one H200. A GPU model whose forms rank otherwise replaces a
# table's entries by (chunks, variant) here, keyed as ``presets.gpu_keys`` names the model first
# (tables: "cooperative", "wide", "parked", "broad", "hinted_broad_held"; an entry absent: the
# H200's). One H100 (132 SMs, 50 MiB of L2), tp = 1, CUDA graphs, us, two rounds where two are given
# (``bench/results/h100_tp1_forms.json`` runs 5, 6 and 8; the strong tail's fastest form last):
# - 1000 / 1024 rows, where the H200 took the parked form (hinted): H = 4096 plain wide (hinted)
#   29.07 / 29.76-30.54 against parked 30.00 / 30.55-30.59 (strong 28.92 / 29.46-29.61); 5120 plain
#   wide (hinted) 37.20 / 37.99 against 37.83 / 38.67 (36.87 / 37.69); 7168 plain broad 51.12 /
#   52.10-52.15 against 52.31 / 53.52-53.61 (51.21 / 51.92-52.14); 4096 quant, which took the wide
#   twin, the broad held twin hinted 30.26-30.34 / 31.36 against 31.57-31.98 / 32.49 (30.19-30.36 /
#   30.96).
# - 2048 rows, the cooperative form (capped) against the form the calls took: H = 5120 plain 72.45 /
#   72.46 against 76.46 / 76.90 (parked; the wide twin 73.77 / 73.93, strong 74.74), quant 78.95
#   against 81.09 (parked; strong 79.53).
# - H = 5120 plain at few rows, the cooperative form against the wide twin: M = 64 2.90-3.07 against
#   3.78-3.97, but M = 100 4.15-4.31 against 3.94-4.47 (hinted 3.92-4.10; strong 4.04-4.23) and M =
#   128 4.23-4.28 against 4.19-4.21; M = 160 / 192 the parked form (hinted) 5.16-5.18 / 5.41-5.79
#   against 5.47-5.50 / 5.88-5.91 (cooperative, capped) and 5.44-5.45 / 5.46-5.50 (wide). The edge,
#   two rounds: M = 72 / 80 / 88 cooperative 3.38-3.40, 3.29-3.32, 3.33-3.34 against the wide twin's
#   3.81-3.82, 3.84, 3.89-3.90; M = 100 3.94-3.95 (wide, hinted) against 4.15-4.16 (strong 4.02-4.04).
# - H = 4096 from 9 rows per SM plain, 11 quant, the cooperative form (capped) against the form the
#   calls took, one round: plain M = 1280 / 1536 / 2048 / 3072 / 4096 / 8192 37.47 / 43.97 / 57.87 /
#   85.38 / 112.93 / 223.12 against 39.17 / 45.94 / 58.86 / 87.01 / 115.36 / 226.70 (strong 37.96 /
#   43.78 / 58.48 / 88.95 / 118.44 / 233.82); quant M = 1536 / 2048 / 3072 / 4096 / 8192 47.00 /
#   62.11 / 91.27 / 120.32 / 237.32 against 49.58 / 63.02 / 93.91 / 122.64 / 241.51 (strong 46.64 /
#   64.02 / 96.77 / 127.06 / 249.56); but M = 1000 / 1024 plain 29.65 / 30.51 against 28.80 / 30.42,
#   quant 31.75 / 32.59 against 30.79 / 31.83.
MODEL_WINDOWS: dict[str, dict[str, dict[tuple[int, str], tuple]]] = {
    "h100": {
        "cooperative": {(4, "plain"): ((0, 0.85), (1, 1.25), (9, 64)), (4, "quant"): ((0, 0.85), (1, 1.35), (11, 64)),
                        (5, "plain"): ((0, 0.7), (12, 16)), (5, "quant"): ((0, 1.5), (12, 16))},
        "parked": {(4, "plain"): (), (5, "plain"): (), (7, "plain"): ()},
        "broad": {(7, "plain"): ((0.85, 1.0), (7, 8), (11, 16))},
        "hinted_broad_held": {(4, "quant"): ((7, 8),)},
    },
}


def model_windows(table: dict, name: str, model: str | None) -> dict:
    """``table`` (a window table above, ``name`` in ``MODEL_WINDOWS``) as measured on ``model``: the
    model's entries over the H200's."""
    return {**table, **MODEL_WINDOWS.get(model, {}).get(name, {})}


def describe_windows(model: str | None) -> str:
    """Which windows the local forms take on a GPU of ``model`` (``python -m lamport_mhc info``)."""
    if model in MODEL_WINDOWS:
        return (f"triton local forms: the windows measured on the {model} ({', '.join(MODEL_WINDOWS[model])}), "
                "else the H200's")
    return "triton local forms: the windows measured on the H200"


UNBOUNDED = 1 << 62  # more rows (or clusters) than any call has


def wide_window(hidden: int, variant: str, local_x: bool, sms: int, model: str | None = None) -> tuple[int, int]:
    """(at most, at least): the rows of the local streaming calls of ``variant`` (of x, or the
    finalize's) that take its wide twin on a GPU of ``sms`` SMs, of ``model`` (``LOCAL_X_WIDE_ROWS_PER_SM``
    where measured, else ``WIDE_ROWS_PER_SM`` and ``TILED_WIDE_MIN_ROWS_PER_SM``, or the four-chunk
    twin's many rows)."""
    many = wide_takes_many_rows(hidden, variant, local_x)
    table = model_windows(LOCAL_X_WIDE_ROWS_PER_SM, "wide", model)
    measured = table.get((row_chunks(hidden)[1], variant)) if local_x else None
    if measured is not None:
        fewest, most = measured
    elif four_chunk_wide(hidden, variant):
        fewest, most = 0, FOUR_CHUNK_WIDE_MIN_ROWS_PER_SM
    else:
        fewest, most = WIDE_ROWS_PER_SM, TILED_WIDE_MIN_ROWS_PER_SM
    return int(fewest * sms), math.ceil(most * sms) if many else UNBOUNDED


class TritonBackend:
    name = "triton"

    def support(self, spec: BuildSpec, device: torch.device) -> Support:
        answer = cuda_device_support(device, MIN_CAPABILITY, "PDL, multimem", "Triton kernels need a CUDA device "
                                     "(on CPU use lamport_mhc.SimulatedGroup, which interprets them)")
        return answer if not answer.ok else symmetric_memory_support(spec, device)

    def build(self, spec: BuildSpec, workspace: Workspace, interpret: bool = False) -> TritonKernels:
        return TritonKernels(spec, workspace, interpret)

    def compile_offline(self, spec: BuildSpec, arch: str) -> dict[str, str]:
        from .offline import compile_ptx
        return compile_ptx(spec, arch)


class TritonKernels:
    def __init__(self, spec: BuildSpec, workspace: Workspace, interpret: bool):
        self.spec = spec
        self.workspace = workspace
        self.interpret = interpret
        self.plan = kernel_plan(spec, on_gpu=not interpret)
        self.chunks = row_chunks(spec.hidden)[1]
        device = workspace.error.device
        # Stand-ins for pointer arguments a specialization never dereferences.
        self._unused = {dtype: torch.zeros(16, dtype=dtype, device=device)
                        for dtype in (torch.int16, torch.float32, torch.int32, torch.uint8, torch.int64)}
        self.cooperative_split = cooperative_split(self.chunks)
        # Where the simulated group's cooperative form parks its chunk roots (on the GPU they pass
        # through the cluster's shared memory): [capacity, chunks].
        self.parked_roots = (torch.zeros(spec.capacity * self.chunks, dtype=torch.float32, device=device)
                             if interpret else self._unused[torch.float32])
        properties = None if interpret else torch.cuda.get_device_properties(device)
        # Programs that wait for their twins on other ranks must all be resident: one per SM is.
        self.resident = None if interpret else properties.multi_processor_count
        # The GPU model whose measured windows the local calls take (``MODEL_WINDOWS``; a model it lacks,
        # or None under the interpreter: the H200's).
        self.model = None if interpret else device_keys(device)[0]
        self.derive_bounds()
        self.l2_bytes = None if interpret else properties.L2_cache_size
        # The LL mailbox's table and multicast address (a group of one has none). Every launch passes
        # the same scalar values as the warm-up, so no call specializes (and recompiles) a kernel.
        self._ll_peers = self._unused[torch.int64] if workspace.ll is None else workspace.ll.peers
        self._ll_multicast = 0 if workspace.ll is None else workspace.ll.multicast
        # Compiled cooperative local consumers, their own shared memory and the spreads their calls
        # choose from (``spread``). A compiled kernel is shared by every build with the same
        # constexprs, so each launch sets its own shared memory.
        self._spreads: dict[str, tuple[object, int, tuple[Spread, ...]]] = {}
        self._compiled: dict[str, object] = {}
        # Called with (kernel name, programs) at every launch (the concurrent one-GPU group's residency check).
        self.on_launch = None
        if not interpret:
            self._compile_all()
            if spec.tp > 1:
                pin_build(self)  # lamport_mhc.carveout: waiting kernels must not starve a peer's

    def derive_bounds(self) -> None:
        """The rows at which each call takes each form, from ``resident`` (None: no SMs are known, as
        under the interpreter, where only the general bounds hold)."""
        self.split_rows = self._split_rows()
        # The local calls of each variant (``local_x``: of x, else the finalize's) take the
        # cooperative form in these windows of rows (calls with a mailbox: ``split_rows``).
        self.local_split_windows = {(variant, local_x): self._local_split_windows(variant, local_x)
                                    for variant in VARIANT_CODES for local_x in (True, False)}
        # Local calls of x of more rows than this take the capped cooperative twin, where they are
        # also past the uncapped one's resident clusters.
        self.local_x_capped_rows = self._local_x_capped_rows()
        # Local calls in STREAMED_ROWS that move (most of) the L2 take the hinted twins
        # (``traffic.streams_past_l2``).
        self.streamed_rows = STREAMED_ROWS
        # Local calls of at least this many rows take the held twins, where the plan has them (the
        # calls of x of each variant also in local_x_held_windows).
        self.held_rows = HELD_MIN_ROWS
        self.local_x_held_windows = self._local_x_windows(LOCAL_X_HELD_ROWS_PER_SM)
        # Local calls of x in these windows of rows take the ``_broad`` twin, where the plan has one,
        # and in the parked ones the parked form where the wide twin's window would take them.
        self.local_x_broad_windows = self._local_x_windows(LOCAL_X_BROAD_ROWS_PER_SM, "broad")
        # Local calls of x in these windows of rows take the ``_broad_held`` twin (in the hinted ones
        # its hinted twin), where the plan has one, before any other form.
        self.local_x_broad_held_windows = self._local_x_windows(LOCAL_X_BROAD_HELD_ROWS_PER_SM)
        self.local_x_hinted_broad_held_windows = self._local_x_windows(LOCAL_X_HINTED_BROAD_HELD_ROWS_PER_SM,
                                                                       "hinted_broad_held")
        self.local_x_parked_windows = self._local_x_windows(LOCAL_X_PARKED_ROWS_PER_SM, "parked")
        # Local calls of x of at most this many rows that take the wide twin take its hinted twin.
        self.local_x_hinted_wide_rows = {variant: 0 if self.resident is None else int(
            LOCAL_X_HINTED_WIDE_ROWS_PER_SM.get((self.chunks, variant), 0) * self.resident) for variant in VARIANT_CODES}
        # Local streaming calls of at most wide_rows[variant, local_x][0] or at least [1] rows take
        # the wide twins, where the plan has them (``local_x``: the calls of x, else the finalize's).
        self.wide_rows = {(variant, local_x): self._wide_window(variant, local_x)
                          for variant in VARIANT_CODES for local_x in (True, False)}

    def _split_rows(self) -> int:
        """Calls of at most this many rows take the cooperative form (a program per chunk of a token):
        by default while the call's programs fit one wave; on CPU never, unless asked."""
        if self.cooperative_split is None:
            return 0
        if self.spec.split_rows is not None:
            return self.spec.split_rows
        if self.resident is None:
            return 0
        return COOPERATIVE_PROGRAMS_PER_SM * self.resident // self.chunks

    def _local_split_windows(self, variant: str, local_x: bool) -> tuple[tuple[int, int], ...]:
        """The windows of rows (above, at most) whose local calls of ``variant`` (of x, or the
        finalize's) take the cooperative form: as measured (``LOCAL_X_COOPERATIVE_ROWS_PER_SM``,
        ``LOCAL_FINALIZE_COOPERATIVE_ROWS_PER_SM``), else ``split_rows``'."""
        if local_x:
            table = model_windows(LOCAL_X_COOPERATIVE_ROWS_PER_SM, "cooperative", self.model)
            measured = table.get((self.chunks, variant))
        else:
            most = LOCAL_FINALIZE_COOPERATIVE_ROWS_PER_SM.get(self.chunks) if variant != "residual" else None
            measured = None if most is None else ((0, most),)
        if measured is None or self.spec.split_rows is not None or self.resident is None:
            return ((0, self.split_rows),)
        return self._rows_of(measured)

    def _rows_of(self, windows: tuple[tuple[float, float], ...]) -> tuple[tuple[int, int], ...]:
        """Windows of rows per SM (above, at most) as windows of rows on this GPU."""
        return tuple((int(above * self.resident), int(most * self.resident)) for above, most in windows)

    def _local_x_capped_rows(self) -> int:
        """``LOCAL_X_CAPPED_MIN_ROWS_PER_SM`` on this GPU (unmeasured widths, the interpreter and
        builds given ``split_rows``: every call past the resident clusters)."""
        measured = LOCAL_X_CAPPED_MIN_ROWS_PER_SM.get(self.chunks)
        if measured is None or self.spec.split_rows is not None or self.resident is None:
            return 0
        return UNBOUNDED if math.isinf(measured) else int(measured * self.resident)

    def _local_x_windows(self, table: dict, name: str | None = None) -> dict[str, tuple[tuple[int, int], ...]]:
        """A table of windows of rows per SM by (chunks, variant) (``name``: its name in
        ``MODEL_WINDOWS``, where this GPU's model may replace entries) as each variant's windows of
        rows on this GPU (none where unmeasured, or no SMs are known)."""
        table = model_windows(table, name, self.model) if name else table
        return {variant: () if self.resident is None else self._rows_of(table.get((self.chunks, variant), ()))
                for variant in VARIANT_CODES}

    def _wide_window(self, variant: str, local_x: bool) -> tuple[int, int]:
        """``wide_window`` on this GPU (no SMs known, as under the interpreter: every call, where the
        wide twin takes many rows)."""
        if self.resident is None:
            return 0, 0 if wide_takes_many_rows(self.spec.hidden, variant, local_x) else UNBOUNDED
        return wide_window(self.spec.hidden, variant, local_x, self.resident, self.model)

    def _split(self, m: int, waits_for_twins: bool = False, local: tuple[str, bool] | None = None) -> int:
        """Programs per token of a call of ``m`` rows (``local``: a local call's (variant, local_x))."""
        if local is None:
            split = m <= self.split_rows
        else:
            split = any(above < m <= most for above, most in self.local_split_windows[local])
        if waits_for_twins and self.resident is not None:
            split = split and m * self.chunks <= self.resident
        return self.cooperative_split if split else 1

    def _resident_clusters(self, name: str) -> int:
        """How many clusters of a cooperative local kernel the GPU holds at once (unbounded where
        unmeasured: the interpreter, or no spread)."""
        spreads = self._spreads[name][2] if name in self._spreads else ()
        return max((spread.clusters for spread in spreads), default=UNBOUNDED)

    # -- launching -------------------------------------------------------------------------------
    def _launch(self, name: str, grid, *args, **overrides):
        """``grid`` counts programs; ``overrides`` replace constexprs, only the interpreter takes them
        (compiled kernels are fixed)."""
        instance = self.plan[name]
        if self.on_launch is not None:
            self.on_launch(name, math.prod(grid))
        if self.interpret:
            launch_interpreted(instance.fn, grid, *args, **{**instance.constexprs, **overrides})
        else:
            if overrides:
                raise ValueError(f"{name}: constexpr overrides {sorted(overrides)} are for the interpreter only")
            grid = (grid[0] // instance.cluster, *grid[1:])  # the launcher counts clusters (set_launch_shape)
            if name in self._spreads:
                compiled, own_shared, spreads = self._spreads[name]
                spread = choose(spreads, grid[0])
                set_launch_shared_bytes(compiled, own_shared if spread is None else spread.shared_bytes)
            instance.fn[grid](*args, **instance.constexprs, **instance.options, launch_pdl=self.spec.use_pdl)

    def _launch_consumer(self, name: str, m: int, *args, waits_for_twins: bool = False, phases: str = "both",
                         streamed: bool = False, variant: str = "plain", local: bool = False,
                         local_x: bool = False):
        """One launch of ``m * split`` programs (a token's adjacent; ``local``: a local call, of x with
        ``local_x``): the cooperative form, by its capped twin past its resident clusters (and for
        calls of x, ``local_x_capped_rows``); or a streaming form, by its wide twin in ``wide_rows``'
        windows, else its held twin from ``held_rows`` rows (calls of x also in
        ``local_x_held_windows``); calls of x in ``local_x_broad_held_windows`` (hinted:
        ``local_x_hinted_broad_held_windows``) take the broad held twin, in ``local_x_broad_windows``
        the broad twin, and in ``local_x_parked_windows`` no wide one; the parked, wide or broad held
        form with ``streamed`` (the wide one also in ``local_x_hinted_wide_rows``) takes its hinted twin.
        The interpreter, which runs programs one after another, runs a cooperative form's normalize
        as a second launch, once every program has left its chunk root."""
        def in_window(windows):
            return local_x and any(lo < m <= hi for lo, hi in windows[variant])

        hinted_broad_held = in_window(self.local_x_hinted_broad_held_windows)
        broad_held = ((hinted_broad_held or in_window(self.local_x_broad_held_windows))
                      and f"{name}_broad_held" in self.plan)
        broad = not broad_held and in_window(self.local_x_broad_windows) and f"{name}_broad" in self.plan
        split = 1 if broad or broad_held else self._split(m, waits_for_twins, (variant, local_x) if local else None)
        fewest, most = self.wide_rows[variant, local_x]
        wide = ((m <= fewest or m >= most) and not in_window(self.local_x_parked_windows)
                and f"{name}_wide" in self.plan)
        held = (m >= self.held_rows or in_window(self.local_x_held_windows)) and f"{name}_held" in self.plan
        form = ("_broad_held" if broad_held else "_broad" if broad else "_split" if split > 1 else "_wide" if wide
                else "_held" if held else "")
        name += form
        capped = m > self._resident_clusters(name) and (not local_x or m > self.local_x_capped_rows)
        if form == "_split" and capped and f"{name}_capped" in self.plan:
            name += "_capped"
        hinted_wide = form == "_wide" and local_x and m <= self.local_x_hinted_wide_rows[variant]
        if (streamed or hinted_wide or (broad_held and hinted_broad_held)) and form in ("", "_wide", "_broad_held"):
            name += "_streamed"
        if not self.interpret:
            if phases != "both":
                raise ValueError(f"{name}: a compiled kernel runs all its phases in one launch, got {phases!r}")
            return self._launch(name, (m * split,), *args)
        code = PHASE_CODES[phases]
        launches = [code & ~NORMALIZE_PHASE.value, code & NORMALIZE_PHASE.value] if split > 1 else [code]
        for phases_code in filter(None, launches):
            self._launch(name, (m * split,), *args, PHASES=phases_code)

    def _compile_all(self) -> None:
        """Compile every kernel now, so no call (and no CUDA-graph capture) compiles."""
        for name, instance in self.plan.items():
            args = [self._placeholder(arg, kind) for arg, kind in instance.signature.items()]
            compiled = instance.fn.warmup(*args, grid=(1,), **instance.constexprs, **instance.options,
                                          launch_pdl=self.spec.use_pdl)
            self._compiled[name] = compiled
            if instance.cluster > 1:
                set_launch_shape(compiled, instance.cluster, 0)
            if instance.cluster > 1 and instance.constexprs["LOCAL"]:  # spread measured at tp = 1 only
                compiled._init_handles()
                own_shared = compiled.packed_metadata[2]  # as set_launch_shape left it
                self._spreads[name] = compiled, own_shared, measure_spreads(
                    compiled.function, self.workspace.error.device.index, instance.cluster, 32 * instance.num_warps,
                    own_shared, SPREAD_MIN_CTAS_PER_SM)

    def load_modules(self) -> None:
        """Load every compiled kernel's module now (Triton loads it at the first launch otherwise)."""
        for compiled in self._compiled.values():
            compiled._init_handles()

    def footprint(self, name: str) -> tuple[int, int, int]:
        """(CUfunction, threads per CTA, dynamic shared bytes) of a compiled kernel, for occupancy."""
        compiled = self._compiled[name]
        compiled._init_handles()
        return compiled.function, 32 * compiled.metadata.num_warps, compiled.packed_metadata[2]

    def _placeholder(self, arg: str, kind: str):
        """An argument of the kind a real launch passes (scalars typed as at run time)."""
        pointers = {"*i16": torch.int16, "*fp32": torch.float32, "*i32": torch.int32, "*u8": torch.uint8,
                    "*i64": torch.int64}
        if kind in pointers:
            return self._unused[pointers[kind]]
        if arg == "multicast_address":
            return self._ll_multicast
        if arg == "sums_multicast_address":
            return self.workspace.bt_sums.multicast
        if arg == "timeout_ns":
            return self.spec.spin_timeout_ns
        if arg in ("slots", "capacity"):
            return self.spec.capacity
        return {"i32": 2, "fp32": 1e-6}[kind]

    # -- the Kernels interface ---------------------------------------------------------------------
    def publish(self, protocol: str, x: torch.Tensor) -> None:
        mailbox = self.workspace.contributions(protocol)
        self._launch(f"publish_{protocol}", (x.shape[0], self.chunks), x.view(torch.int16), self._unused[torch.int16],
                     self._unused[torch.float32], self._unused[torch.int32], self.workspace.state(protocol),
                     mailbox.peers, mailbox.multicast, self.spec.slots(protocol))

    def finalize_publish(self, protocol: str, gemm2, weights, indices, shared) -> None:
        mailbox = self.workspace.contributions(protocol)
        self._launch(f"finalize_publish_{protocol}", (shared.shape[0], self.chunks), shared.view(torch.int16),
                     gemm2.view(torch.int16), weights, indices, self.workspace.state(protocol), mailbox.peers,
                     mailbox.multicast, self.spec.slots(protocol))

    def owner_reduce(self, m: int) -> None:
        ws, spec = self.workspace, self.spec
        self._launch("owner_reduce_bt", (max(1, -(-m // spec.tp)), self.chunks), ws.bt.local, ws.bt_sums.peers,
                     ws.bt_sums.multicast, ws.bt_state, ws.error, m, self.spec.spin_timeout_ns, spec.owner_capacity,
                     spec.rows("bt"))

    def consume(self, protocol: str, args: ConsumerArgs) -> None:
        i16, f32, i32 = self._unused[torch.int16], self._unused[torch.float32], self._unused[torch.int32]
        self._launch_consumer(f"consumer_{protocol}_{args.variant}", args.residual.shape[0],
                              *self._consumer_args(protocol, args), i16, i16, f32, i32, self._ll_peers,
                              self._ll_multicast)

    def publish_and_consume(self, call: Call, phases: str = "both") -> None:
        name, publish = self._with_contribution("one_kernel", call)
        self._launch_consumer(f"{name}_ll_{call.consumer.variant}", call.m, *self._consumer_args("ll", call.consumer),
                              *publish, self._ll_peers, self._ll_multicast, waits_for_twins=True, phases=phases)

    def local(self, call: Call) -> None:
        name, publish = self._with_contribution("local", call)
        self._launch_consumer(f"{name}_{call.consumer.variant}", call.m, *self._consumer_args("local", call.consumer),
                              *publish, self._ll_peers, self._ll_multicast, streamed=self._streamed(call),
                              variant=call.consumer.variant, local=True, local_x=call.kind != "finalize")

    def _streamed(self, call: Call) -> bool:
        """Whether a local call takes the hinted twin (``traffic.streams_past_l2``)."""
        spec = self.spec
        return streams_past_l2(call.variant, call.m, spec.hidden, spec.hc, spec.top_k, self.l2_bytes,
                               self.streamed_rows)

    def _with_contribution(self, prefix: str, call: Call) -> tuple[str, tuple]:
        """The kernel name's stem and the contribution's arguments (x, or the finalize inputs)."""
        if call.kind == "finalize":
            return f"{prefix}_finalize", (call.shared.view(torch.int16), call.gemm2.view(torch.int16), call.weights,
                                          call.indices)
        return prefix, (call.x.view(torch.int16), self._unused[torch.int16], self._unused[torch.float32],
                        self._unused[torch.int32])

    def _consumer_args(self, protocol: str, args: ConsumerArgs) -> list:
        """The consumer's arguments up to ``parked_roots_ptr`` (the contribution's arguments follow)."""
        ws = self.workspace
        source = {"bt": lambda: ws.bt_sums.local, "ll": lambda: ws.ll.local,
                  "local": lambda: self._unused[torch.int16]}[protocol]()
        residual_only = args.variant == "residual"
        i16, f32, u8 = self._unused[torch.int16], self._unused[torch.float32], self._unused[torch.uint8]
        return [source, args.residual.view(torch.int16), args.post, args.comb, f32 if residual_only else args.pre,
                i16 if residual_only else args.norm_weight.view(torch.int16), args.residual_out.view(torch.int16),
                i16 if residual_only else args.layer_input.view(torch.int16),
                u8 if args.mxfp8_values is None else args.mxfp8_values.view(torch.uint8),
                u8 if args.mxfp8_scales is None else args.mxfp8_scales, ws.state(protocol), ws.error,
                float(args.norm_eps), args.residual.shape[0], self.spec.spin_timeout_ns, self.spec.rows(protocol),
                self.parked_roots]
