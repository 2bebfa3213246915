#!/usr/bin/env bash
# Compiles the `cuda` fabric's kernels (the `KERNELS` string of src/fabric/cuda/kernels.rs) with NVRTC on a machine without a
# GPU, so that a kernel that does not compile fails CI instead of the first GPU run. NVRTC comes from its pinned
# wheel (`nvidia-cuda-nvrtc`, about 40 MB, no CUDA toolkit or driver needed); the program is compiled with NVRTC's
# default options, as the fabric compiles it at start-up (`cudarc::nvrtc::compile_ptx` in `CudaTransport::new`),
# through ctypes.
# Idempotent: a second run downloads nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=13.5.37
DIR=target/nvrtc
mkdir -p "$DIR"
if ! ls "$DIR"/nvidia_cuda_nvrtc-"$VERSION"-*.whl >/dev/null 2>&1; then
    python3 -m pip download -q --no-deps "nvidia-cuda-nvrtc==$VERSION" -d "$DIR"
fi
if ! find "$DIR/lib" -name 'libnvrtc.so*' 2>/dev/null | grep -q .; then
    python3 -m zipfile -e "$DIR"/nvidia_cuda_nvrtc-"$VERSION"-*.whl "$DIR/lib"
fi
python3 - src/fabric/cuda/kernels.rs "$DIR/lib" <<'PY'
import ctypes, pathlib, re, sys

source, lib_dir = sys.argv[1], pathlib.Path(sys.argv[2])
# libnvrtc, not its builtins library (loaded by libnvrtc itself).
libs = sorted(p for p in lib_dir.rglob("libnvrtc.so*") if "builtins" not in p.name)
if not libs:
    sys.exit(f"nvrtc: no libnvrtc.so under {lib_dir}")
for builtins in sorted(lib_dir.rglob("libnvrtc-builtins.so*")):
    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
nvrtc = ctypes.CDLL(str(libs[0]))
found = re.search(r'const KERNELS: &str = r#"(.*?)"#;', open(source).read(), re.S)
if not found:
    sys.exit(f"nvrtc: no KERNELS string in {source}")
program = ctypes.c_void_p()
if nvrtc.nvrtcCreateProgram(ctypes.byref(program), found.group(1).encode(), b"kvrelay_kernels.cu", 0, None, None):
    sys.exit("nvrtc: nvrtcCreateProgram failed")
result = nvrtc.nvrtcCompileProgram(program, 0, None)
size = ctypes.c_size_t()
nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
log = ctypes.create_string_buffer(size.value)
nvrtc.nvrtcGetProgramLog(program, log)
text = log.value.decode(errors="replace").strip()
if result != 0:
    sys.exit(f"nvrtc: the kernels of {source} do not compile (result {result}):\n{text}")
kernels = re.findall(r'extern "C" __global__ void (\w+)', found.group(1))
print(f"nvrtc: {len(kernels)} kernels of {source} compile ({', '.join(kernels)})" + (f"\n{text}" if text else ""))
PY
