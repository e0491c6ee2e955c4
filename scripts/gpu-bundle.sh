#!/bin/sh
# gpu-bundle.sh builds, on a machine with Go and UCX, everything the CUDA
# checks need on a GPU machine that has neither: the test binaries of the
# packages with a cuda leg, the troupe and jacobi3d programs, and the shared
# libraries they load (UCX and its transport modules), compressed into .gpu/
# (ignored by git). scripts/gpu-check.sh runs them there.
set -eu
cd "$(dirname "$0")/.."
out=.gpu
rm -rf "$out" && mkdir -p "$out/bin" "$out/lib/ucx"
flags='-ldflags=-s -w'
go test -c "$flags" -o "$out/bin/gpu.test" ./gpu/
go test -c -race "$flags" -o "$out/bin/gpu-race.test" ./gpu/
go test -c "$flags" -o "$out/bin/gpupack.test" ./gpupack/
go test -c "$flags" -o "$out/bin/integration.test" ./integration/
go test -c "$flags" -o "$out/bin/jacobi.test" ./samples/jacobi3d/jacobi/
go test -c "$flags" -o "$out/bin/jacobi3d.test" ./samples/jacobi3d/
go build "$flags" -o "$out/bin/troupe" ./cmd/troupe
go build "$flags" -o "$out/bin/jacobi3d" ./samples/jacobi3d
go build "$flags" -o "$out/bin/faces" ./samples/faces
# TROUPE_BUNDLE_BASE=<rev>: troupe as of that revision too, as troupe-base,
# for A/B runs in one session (gpu-check.sh msgab)
if [ -n "${TROUPE_BUNDLE_BASE:-}" ]; then
	base=$(mktemp -d)
	git worktree add -q --detach "$base" "$TROUPE_BUNDLE_BASE"
	(cd "$base" && go build "$flags" -o "$OLDPWD/$out/bin/troupe-base" ./cmd/troupe)
	git worktree remove --force "$base"
fi
# the protoactor-go reference of `troupe bench actor --compare`
go build "$flags" -o "$out/bin/protobench" ./samples/protobench
# the raw UCX reference of `troupe bench pingpong --compare`
cp "$(command -v ucx_perftest)" "$out/bin/"
# UCX, its CMA transport module (no InfiniBand there) and what they link,
# but not the C library: the GPU machine's newer glibc runs binaries linked
# against ours.
moddir=$(pkg-config --variable=libdir ucx)/ucx
for f in "$out"/bin/* "$moddir"/libuct_cma.so.0; do ldd "$f" 2>/dev/null; done |
	awk '$3 ~ /^\// {print $3}' | sort -u |
	grep -Ev '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
	while read -r l; do cp -L "$l" "$out/lib/"; done
cp -L "$moddir"/libuct_cma.so.0 "$out/lib/ucx/"
tar -C "$out" -cJf "$out.tar.xz" bin lib
rm -rf "$out"/bin "$out"/lib
mv "$out.tar.xz" "$out/bundle.tar.xz"
ls -l "$out"
