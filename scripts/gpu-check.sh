#!/bin/bash
# gpu-check.sh runs, on a GPU machine without Go, what scripts/gpu-bundle.sh
# built: the CUDA test suites on the real driver, the GPU benchmark and
# Jacobi3D on the device. Each step's output goes to $OUT/<step>.log (or
# ./gpu-logs) and a summary line per step to stdout.
#   scripts/gpu-check.sh [step...]
# steps: info gpu gpupack gpurace msgab gpubench kcopy acopy agentab ncab integration jacobi bench benchhost run faces pingpong actor overlap lat8
set -u
cd "$(dirname "$0")/.."
root=$PWD
logs=${OUT:-$root/gpu-logs}
mkdir -p "$logs"
g=/tmp/troupe-gpu
if [ ! -x "$g/bin/troupe" ]; then
	mkdir -p "$g" && tar -C "$g" -xJf .gpu/bundle.tar.xz || exit 1
fi
export LD_LIBRARY_PATH=$g/lib UCX_MODULE_DIR=$g/lib/ucx UCX_LOG_LEVEL=error
B=$g/bin
export PATH=$B:$PATH
steps=${*:-info gpu gpupack integration jacobi bench run}

step() { # step NAME DIR SECONDS COMMAND...: run COMMAND in DIR for at most SECONDS, log it, summarise
	local name=$1 dir=$2 limit=$3 t0=$SECONDS rc
	shift 3
	(cd "$dir" && timeout -k 5 "$limit" "$@") >"$logs/$name.log" 2>&1
	rc=$?
	echo "== $name: exit $rc, $((SECONDS - t0)) s; $(grep -cE '^(---|    ---) PASS' "$logs/$name.log") PASS, $(grep -cE -- '--- FAIL' "$logs/$name.log") FAIL, $(grep -cE -- '--- SKIP' "$logs/$name.log") SKIP"
	grep -E -- '--- (FAIL|SKIP)' "$logs/$name.log" | head -20
}

for s in $steps; do
	case $s in
	info)
		nvidia-smi -L >"$logs/info.log" 2>&1
		"$B/troupe" info >>"$logs/info.log" 2>&1
		cat "$logs/info.log" ;;
	gpu)
		step gpu gpu 150 env TROUPE_GPU=cuda "$B/gpu.test" -test.v -test.count=1 -test.timeout=300s ;;
	gpupack) # datatype pack and unpack kernels on the device, then their benchmark beside a D2D copy
		step gpupack gpupack 120 env TROUPE_GPU=cuda "$B/gpupack.test" -test.v -test.count=1 -test.timeout=100s
		(cd gpupack && TROUPE_GPU=cuda timeout -k 5 150 "$B/gpupack.test" -test.run '^$' -test.bench Layouts -test.benchtime 200x) >"$logs/gpupackbench.log" 2>&1
		echo "== gpupack bench: exit $?"; grep -E 'Benchmark|device|ok|FAIL' "$logs/gpupackbench.log" ;;
	integration)
		step integration integration 240 "$B/integration.test" -test.v -test.count=1 -test.timeout=400s \
			-test.run 'TestGPUCUDA|TestGPUQueueCUDA|TestGPUChannelIPC|TestGPUChannelsCUDAIPC|TestGPUMessagingIPC' ;;
	jacobi)
		step jacobi samples/jacobi3d/jacobi 120 "$B/jacobi.test" -test.v -test.count=1 -test.timeout=300s -test.run 'TestRunGPUCUDA'
		step jacobi3d samples/jacobi3d 150 "$B/jacobi3d.test" -test.v -test.count=1 -test.timeout=300s -test.run 'TestProcessesGPU' ;;
	bench)
		timeout -k 5 150 "$B/troupe" bench gpu --backend cuda >"$logs/bench.log" 2>&1
		echo "== bench gpu: exit $?"; cat "$logs/bench.log" ;;
	msgab) # small-message latency, troupe-base (TROUPE_BUNDLE_BASE) against troupe, alternated
		for i in 1 2; do for b in troupe-base troupe; do
			echo "# $b"; timeout -k 5 60 "$B/$b" bench gpu --backend cuda --max 8192 --scale 0.5
		done; done >"$logs/msgab.log" 2>&1
		echo "== msgab: exit $?"; grep -vE '^# (msg|troupe bench)' "$logs/msgab.log" ;;
	gpurace) # the gpu suite on cuda under the race detector
		step gpurace gpu 200 env TROUPE_GPU=cuda "$B/gpu-race.test" -test.v -test.count=1 -test.timeout=180s ;;
	gpubench) # stream copy + synchronize, per direction and size
		(cd gpu && timeout -k 5 120 "$B/gpu.test" -test.run '^$' -test.bench StreamCopy -test.benchtime 2000x) >"$logs/gpubench.log" 2>&1
		echo "== gpubench: exit $?"; grep -E 'Benchmark|ok|FAIL' "$logs/gpubench.log" ;;
	probe) # small-message latency on cuda under variations, with execution traces
		{
			TROUPE_BENCH_TRACE=/tmp/gtrace timeout -k 5 60 "$B/troupe" bench gpu --backend cuda --max 8192 --scale 0.3
			for r in 0 1; do gzip -c /tmp/gtrace.rank$r >"$logs/trace.rank$r.gz"; done
			echo "# GOMAXPROCS=4"; GOMAXPROCS=4 timeout -k 5 60 "$B/troupe" bench gpu --backend cuda --max 8192 --scale 0.3
			echo "# tcp"; timeout -k 5 60 "$B/troupe" bench gpu --backend cuda --max 8192 --scale 0.3 --tls tcp
		} >"$logs/probe.log" 2>&1
		grep -vE '^# (msg|troupe)' "$logs/probe.log" ;;
	kcopy) # a small copy by a kernel beside the copy engine, + synchronize
		(cd gpu && timeout -k 5 120 "$B/gpu.test" -test.run '^$' -test.bench 'KernelCopy' -test.benchtime 2000x) >"$logs/kcopy.log" 2>&1
		echo "== kcopy: exit $?"; grep -E 'Benchmark|ok|FAIL|rror' "$logs/kcopy.log" ;;
	ncab) # bench noncontig near T, the measured crossover on (TROUPE_NC_CROSSOVER_BAND=4) and off (the default) alternated
		L=vec_4096x16,vec_4096x64,vec_4096x256,vec_4096x1024,vec_16384x16,vec_16384x256,nas_mg_y,vec_4KiB
		for i in 1 2; do for b in 4 0; do
			echo "# TROUPE_NC_CROSSOVER_BAND=$b run $i"
			TROUPE_NC_CROSSOVER_BAND=$b timeout -k 5 140 "$B/troupe" bench noncontig --layout $L --rounds 3 --max-rounds 4 --scale 0.5 2>&1 | grep -vE 'done|counters'
		done; done >"$logs/ncab.log" 2>&1
		cat "$logs/ncab.log" ;;
	agentab) # bench gpu up to 32 KiB, copy agent off and on alternated, CUDA IPC on and off
		for i in 1 2; do for ipc in on off; do for a in off on; do
			echo "# agent=$a ipc=$ipc run $i"
			TROUPE_GPU_AGENT=$a TROUPE_GPU_IPC=$ipc timeout -k 5 60 "$B/troupe" bench gpu --backend cuda --max 32768 | grep -v '^# msg'
		done; done; done >"$logs/agentab.log" 2>&1
		cat "$logs/agentab.log" ;;
	acopy) # a small copy by a resident agent kernel beside the copy engine
		(cd gpu && timeout -k 5 120 "$B/gpu.test" -test.run '^$' -test.bench 'AgentCopy' -test.benchtime 2000x) >"$logs/acopy.log" 2>&1
		echo "== acopy: exit $?"; grep -E 'Benchmark|ok|FAIL|rror' "$logs/acopy.log" ;;
	lat8) # 8 B ping-pong, engine off and on alternated, with CPU profiles of both ranks
		for i in 1 2 3; do
			for e in off on; do
				: >"$logs/lat8-$e$i.json"
				TROUPE_BENCH_OUT=$logs/lat8-$e$i.json TROUPE_CPUPROFILE=$logs/prof-$e$i timeout -k 5 60 "$B/troupe" run -n 2 --tls shm -- \
					"$B/troupe" bench overlap --as-rank --engine $e --latency-only --scale 40 --gather-ranks 0 >/dev/null 2>&1
				echo "lat8 $e $i: $(grep -o '"lat_us":[0-9.]*' "$logs/lat8-$e$i.json")"
			done
		done ;;
	benchhost) # the same on the host backend, small sizes: what the machine costs without CUDA
		timeout -k 5 100 "$B/troupe" bench gpu --backend host --max 65536 >"$logs/benchhost.log" 2>&1
		echo "== bench gpu host: exit $?"; cat "$logs/benchhost.log" ;;
	run)
		for api in channel messaging; do
			timeout -k 5 60 "$B/troupe" run -n 4 --tls shm -- "$B/jacobi3d" -gpu -gpu-api $api -grid 192 -blocks 2x2x2 -warmup 5 -iters 50 -check=false
		done >"$logs/run.log" 2>&1
		timeout -k 5 60 "$B/troupe" run -n 4 --tls shm -- "$B/jacobi3d" -grid 192 -blocks 2x2x2 -warmup 5 -iters 50 -check=false >>"$logs/run.log" 2>&1
		echo "== run: exit $?"; grep -E 'gpu_|iter_ms|comm_ms|residual|rror' "$logs/run.log" ;;
	faces) # each mode alone; a rank still running after 25 s dumps its goroutines
		for m in plain queue; do
			(sleep 25; pkill -QUIT -x faces) &
			w=$!
			timeout -k 5 40 "$B/troupe" run -n 4 --tls shm -- "$B/faces" -L 8 -iters 5 -mode $m
			echo "faces $m: exit $?"
			kill $w 2>/dev/null
		done >"$logs/faces.log" 2>&1
		grep -E 'faces (plain|queue)|match|rror' "$logs/faces.log" ;;
	pingpong)
		timeout -k 5 120 "$B/troupe" bench pingpong --compare 3 >"$logs/pingpong.log" 2>&1
		echo "== pingpong: exit $?"; cat "$logs/pingpong.log" ;;
	actor) # the actor runtime against protoactor-go's gRPC remote, on this machine's CPUs
		timeout -k 5 300 "$B/troupe" bench actor --compare >"$logs/actor.log" 2>&1
		echo "== actor: exit $?"; grep -v '^\[' "$logs/actor.log" ;;
	overlap) # receiver-side overlap, engine on and off, from 1 MiB
		timeout -k 5 200 "$B/troupe" bench overlap --rounds 3 --min 1048576 >"$logs/overlap.log" 2>&1
		echo "== overlap: exit $?"; grep -v '^\[' "$logs/overlap.log" ;;
	esac
done
