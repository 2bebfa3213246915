#!/usr/bin/env bash
# Packs what ci/gpu.sh needs on a GPU machine without network or Rust, built here (x86-64 on both):
#   target/gpu-pack/kvrelay   the CLI, --features cuda,nixl, stripped
#   target/gpu-pack/it        the integration tests, same features, stripped
#   target/gpu-pack/nixl-cu13 the nixl-cu13==1.5.1 wheel's files that libnixl_capi.so, NIXL's UCX plug-in and UCX's
#                             cuda_copy/cuda_ipc/cma modules load (their ELF NEEDED closure within the wheel; about
#                             43 MB of the wheel's 230), laid out as in the wheel so their RPATHs hold
# and the same as target/gpu-pack.tar.xz (about 20 MB). On the GPU machine:
#   mkdir -p target/gpu-pack && tar -xJf gpu-pack.tar.xz -C target/gpu-pack && bash ci/gpu.sh --pack target/gpu-pack
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/engines.sh --nixl-cu13
wheel=target/engines/nixl-cu13
out=target/gpu-pack
rm -rf "$out" target/gpu-pack.tar.xz
mkdir -p "$out/nixl-cu13"
cargo build --locked --release --features cuda,nixl
it=$(cargo test --locked --release --features cuda,nixl --test it --no-run 2>&1 | sed -n 's/.*Executable.*(\(.*\))/\1/p' | tail -1)
strip -o "$out/kvrelay" target/release/kvrelay
strip -o "$out/it" "$it"
# The closure of what NIXL on VRAM loads, resolved inside the wheel (system and driver libraries stay out).
python3 - "$wheel" "$out/nixl-cu13" <<'PY'
import os, shutil, subprocess, sys
wheel, out = sys.argv[1], sys.argv[2]
dirs = ['.nixl_cu13.mesonpy.libs', 'nixl_cu13.libs', 'nixl_cu13.libs/ucx']
todo = ['.nixl_cu13.mesonpy.libs/libnixl_capi.so', '.nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so',
        'nixl_cu13.libs/nixl/libplugin_UCX.so'] + [
        'nixl_cu13.libs/ucx/' + name for name in os.listdir(os.path.join(wheel, 'nixl_cu13.libs/ucx'))
        if name.startswith(('libuct_cuda', 'libucm_cuda', 'libuct_cma')) and name.endswith('.so.0.0.0')]
seen = set()
while todo:
    path = todo.pop()
    if path in seen:
        continue
    seen.add(path)
    dynamic = subprocess.run(['readelf', '-d', os.path.join(wheel, path)], capture_output=True, text=True, check=True)
    for line in dynamic.stdout.splitlines():
        if '(NEEDED)' in line:
            name = line.split('[')[1].rstrip(']')
            todo += [os.path.join(d, name) for d in dirs if os.path.exists(os.path.join(wheel, d, name))][:1]
for path in sorted(seen) + ['nixl_cu13-1.5.1.dist-info/METADATA']:
    os.makedirs(os.path.dirname(os.path.join(out, path)), exist_ok=True)
    shutil.copy2(os.path.join(wheel, path), os.path.join(out, path))
print(f'ci/gpu-pack.sh: {len(seen)} NIXL libraries')
PY
tar -C "$out" -cJf target/gpu-pack.tar.xz .
ls -l target/gpu-pack.tar.xz
