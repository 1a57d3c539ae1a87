"""CuTe DSL kernels of the Lamport all-reduce + mHC op: the same protocol, layouts, state words and
bits as ``kernels_triton``, structured like FlashInfer's ``comm/mnnvl_cutedsl``.

- ``primitives``: every inline-PTX helper (16-byte volatile polls, peer and multicast stores, the
  contract's ``.rn`` fp32 operations, PDL, the spin-bound clock, cluster/DSMEM helpers);
- ``numerics``: bf16 <-> fp32 on integer bits (round to nearest even, NaN -> 0x7FC0, -0.0 -> +0.0);
- ``lamport``: polling with the spin bound, re-arming, broadcasting to every rank, generations;
- ``publish``, ``owner_reduce``: the device kernels before the consumer;
- ``mhc``: the mHC math of one 16-byte fragment, shared by both consumer forms;
- ``consumer``: the cluster form (a token over several CTAs, for few rows; also LL's one-kernel
  forms and a group of one's local form), ``streaming``: the streaming form (a CTA per token,
  looping over the row, for many rows);
- ``plan``, ``offline``: the kernels of a build and their PTX, compiled without a GPU;
- ``launcher``: compiles a build's kernels once and launches them per call (graph-safe);
- ``backend``: ``CuteBackend``, the interface ``lamport_mhc`` selects.

The quant consumer takes the MXFP8 block scale from FlashInfer's own helpers
(``flashinfer.quantization.quantization_cute_dsl_utils``) and converts with the same bits.
Importing anything but ``backend`` needs nvidia-cutlass-dsl, cuda-python and flashinfer-python
(``[cute]`` extra).
"""
