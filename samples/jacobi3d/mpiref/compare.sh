#!/usr/bin/env bash
# compare.sh: troupe's Jacobi3D against the same problem written with MPI
# (jacobi3d_mpi.c), built with Open MPI and with MPICH, on this machine, in
# one run. For each grid and rank count the three programs take turns
# (troupe, Open MPI, MPICH) for the given number of rounds; the best iter_ms of
# each is reported, and every run's field_hash must equal every other's.
#
# Like is compared with like: by default both stencils are vectorised
# (troupe's AVX2 kernel; the C one by gcc -O3 -march=native, which needs
# -ffinite-math-only -fno-signed-zeros to vectorise the residual's maximum
# and gives the same bits), with -s both scalar (troupe built with the tag
# purego, the C one with -O2).
#
# Both programs run -warmup W -iters I (default 200 and 500: past troupe's
# warm-up, while its heap grows into fresh pages, as benchmarks of MPI
# libraries skip theirs; -W 10 -I 100 are the programs' own defaults).
#
# Both cut the grid the same way: one block per rank, the largest rank
# count along z, whose faces are contiguous planes (with -x: along x, the
# order MPI_Dims_create's counts come in, as both did before 2026-11-24).
#
# usage: samples/jacobi3d/mpiref/compare.sh [-g "48 96"] [-n "1 2 4"] [-r 3] [-o] [-p split] [-s] [-x] [-W 200] [-I 500]
#   -g grids, -n rank counts, -r rounds, -o: MPI with -overlap (interior swept
#   while halos travel), -p: troupe run --procs (default split), -s: scalar
#   stencils on both sides, -x: largest rank count along x (1, 2, 3, 4 or 8
#   ranks), -W warm-up sweeps, -I timed sweeps.
# Expects bin/troupe and bin/jacobi3d (make build) and mpicc.openmpi and
# mpicc.mpich (make bench-jacobi-mpi installs them).
set -euo pipefail
cd "$(dirname "$0")/../../.."
grids="48 96" ranks="1 2 4" rounds=3 overlap="" procs=split scalar="" xsplit="" warmup=200 iters=500
while getopts "g:n:r:op:sxW:I:" opt; do
	case $opt in
	g) grids=$OPTARG ;;
	n) ranks=$OPTARG ;;
	r) rounds=$OPTARG ;;
	o) overlap=-overlap ;;
	p) procs=$OPTARG ;;
	s) scalar=1 ;;
	x) xsplit=-xsplit ;;
	W) warmup=$OPTARG ;;
	I) iters=$OPTARG ;;
	*) sed -n '2,29p' "$0" >&2; exit 2 ;;
	esac
done
src=samples/jacobi3d/mpiref/jacobi3d_mpi.c
# kind names the stencil of both sides: vec or scalar.
kind=vec cflags="-O3 -march=native -ffinite-math-only -fno-signed-zeros" jacobi=bin/jacobi3d
if [ -n "$scalar" ]; then
	kind=scalar cflags="-O2" jacobi=bin/jacobi3d-purego
	"${GO:-go}" build -tags purego -o $jacobi ./samples/jacobi3d
fi
for m in openmpi mpich; do
	exe=bin/jacobi3d_mpi-$m-$kind
	if [ ! -x $exe ] || [ $src -nt $exe ] || [ "$0" -nt $exe ]; then
		mpicc.$m $cflags -ffp-contract=off -Wno-stringop-overflow -o $exe $src -lm
	fi
done
# Open MPI refuses root without these, and more ranks than cores without
# --oversubscribe (with which it also yields when idle).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# xblocks prints troupe's -blocks for $1 ranks with the largest count along
# x (what jacobi3d_mpi -xsplit does).
xblocks() {
	case $1 in
	1) echo -blocks 1x1x1 ;;
	2) echo -blocks 2x1x1 ;;
	3) echo -blocks 3x1x1 ;;
	4) echo -blocks 2x2x1 ;;
	8) echo -blocks 2x2x2 ;;
	*) echo "compare.sh: -x knows 1, 2, 3, 4 or 8 ranks, not $1" >&2; exit 2 ;;
	esac
}

# run prints "iter_ms field_hash" of one run of program $1 on $2 ranks, grid $3.
run() {
	local out shape=""
	case $1 in
	troupe)
		[ -n "$xsplit" ] && shape=$(xblocks "$2")
		out=$(bin/troupe run -n "$2" --tls shm --procs "$procs" -- $jacobi -grid "$3" -warmup $warmup -iters $iters -check=false $shape 2>&1 | sed 's/^\[0\] //') ;;
	openmpi) out=$(mpirun.openmpi --oversubscribe -n "$2" bin/jacobi3d_mpi-openmpi-$kind -grid "$3" -warmup $warmup -iters $iters $overlap $xsplit 2>&1) ;;
	mpich) out=$(mpirun.mpich -n "$2" bin/jacobi3d_mpi-mpich-$kind -grid "$3" -warmup $warmup -iters $iters $overlap $xsplit 2>&1) ;;
	esac
	local it h
	it=$(awk '$1 == "iter_ms" {print $2}' <<<"$out")
	h=$(awk '$1 == "field_hash" {print $2}' <<<"$out")
	if [ -z "$it" ] || [ -z "$h" ]; then
		echo "compare.sh: $1 on $2 ranks, grid $3 printed no iter_ms/field_hash:" >&2
		echo "$out" >&2
		exit 1
	fi
	echo "$it $h"
}

split=z
if [ -n "$xsplit" ]; then
	split=x
	for n in $ranks; do xblocks "$n" >/dev/null || exit 2; done
fi
printf "# Jacobi3D, troupe (--procs %s) against MPI%s, %s stencils, largest rank count along %s, %s warm-up + %s timed sweeps, %s round(s), best iter_ms (median ms per sweep) of each\n" "$procs" "${overlap:+ ($overlap)}" "$kind" "$split" "$warmup" "$iters" "$rounds"
printf "%-5s %-6s %12s %12s %12s %14s %s\n" grid ranks troupe openmpi mpich troupe/bestMPI field_hash
for g in $grids; do
	for n in $ranks; do
		declare -A best=()
		hash=""
		for ((r = 0; r < rounds; r++)); do
			for p in troupe openmpi mpich; do
				read -r it h < <(run $p "$n" "$g")
				if [ -n "$hash" ] && [ "$h" != "$hash" ]; then
					echo "compare.sh: $p on $n ranks, grid $g: field_hash $h, another run gave $hash" >&2
					exit 1
				fi
				hash=$h
				if [ -z "${best[$p]:-}" ] || awk -v a="$it" -v b="${best[$p]}" 'BEGIN {exit !(a < b)}'; then
					best[$p]=$it
				fi
			done
		done
		ratio=$(awk -v t="${best[troupe]}" -v a="${best[openmpi]}" -v b="${best[mpich]}" 'BEGIN {m = a < b ? a : b; printf "%.2f", t / m}')
		printf "%-5s %-6s %12s %12s %12s %14s %s\n" "$g" "$n" "${best[troupe]}" "${best[openmpi]}" "${best[mpich]}" "$ratio" "$hash"
		unset best
	done
done
