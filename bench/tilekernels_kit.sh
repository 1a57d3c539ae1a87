#!/usr/bin/env bash
# tile-kernels for the tilekernels-tail rows on a GPU machine that reaches no package registry, in an
# environment of its own (TileLang 0.1.11 needs apache-tvm-ffi 0.1.11; the CuTe DSL kit's 0.1.15 aborts
# it at import).
#
#   bash bench/tilekernels_kit.sh build [DIR]     where pip reaches a registry (default DIR .tilekernels-kit):
#                                                 the wheels of the `tilekernels` extra for CPython 3.12,
#                                                 unpacked and packed as DIR/site.tar.xz (about 34 MB)
#   source bench/tilekernels_kit.sh activate [DIR]  on the GPU machine, from a PYTHONPATH of its own:
#                                                 unpacks it into /tmp once, puts it on PYTHONPATH and
#                                                 keeps TileLang's kernel cache in /tmp/tilekernels-kit
#
# then, e.g., with the main run's results in bench/results:
#   env -u PYTHONPATH bash -c 'source bench/tilekernels_kit.sh activate && torchrun --nproc-per-node 1 \
#     -m lamport_mhc bench --hidden 4096 5120 7168 --paths tilekernels-tail --merge bench/results/h200_tp1.csv'
action=${1:?usage: bench/tilekernels_kit.sh build|activate [DIR]}
kit=${2:-.tilekernels-kit}
case "$action" in
  build) (
    set -euo pipefail
    wheels=$(mktemp -d) site=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$wheels" \
      tile-kernels==1.0.0 tilelang==0.1.11 apache-tvm-ffi==0.1.11 z3-solver==4.15.4.0 torch-c-dlpack-ext==0.1.5
    for wheel in "$wheels"/*.whl; do python3 -m zipfile -e "$wheel" "$site"; done
    # What a CUDA machine never loads: the ROCm kernel templates and z3's command-line binary.
    rm -rf "$site"/tilelang/3rdparty/composable_kernel "$site"/z3_solver-*.data
    mkdir -p "$kit"
    tar cf - -C "$site" . | xz -9 -T0 > "$kit/site.tar.xz"
    rm -rf "$wheels" "$site"
    du -h "$kit/site.tar.xz"
    ) ;;
  activate)
    root=/tmp/tilekernels-kit
    if [ ! -f "$root/site/.complete" ]; then
      rm -rf "$root/site" && mkdir -p "$root/site"
      xz -dc "$kit/site.tar.xz" | tar xf - -C "$root/site" && touch "$root/site/.complete"
    fi
    export PYTHONPATH="$root/site:$PWD" TILELANG_CACHE_DIR="$root/cache" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
    export PATH="$CUDA_HOME/bin:$PATH"
    ;;
  *) echo "usage: bench/tilekernels_kit.sh build|activate [DIR]" >&2; exit 2 ;;
esac
