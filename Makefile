# troupe: build, run the main job, run the tests. Each target installs what it
# needs on a fresh Debian machine (as root) when it is missing.

GO      ?= go
BIN     := bin
RACE_PKGS := ./...

.PHONY: deps test-deps build run test bench bench-mpi bench-jacobi-mpi ptx clean

# deps installs UCX (headers, library, ucx_perftest), pkg-config, gcc and g++
# (the fake CUDA driver's kernels build as C++) and, if no Go
# toolchain is on PATH, Debian's Go (which fetches the go.mod toolchain).
deps:
	@if ! pkg-config --exists ucx 2>/dev/null || ! command -v ucx_perftest >/dev/null 2>&1 || ! command -v gcc >/dev/null 2>&1 || ! command -v g++ >/dev/null 2>&1; then \
		echo "installing libucx-dev ucx-utils pkg-config gcc g++"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libucx-dev ucx-utils pkg-config gcc g++ >/dev/null; \
	fi
	@if ! command -v $(GO) >/dev/null 2>&1; then \
		echo "installing golang-go"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq golang-go >/dev/null; \
	fi

build: deps
	$(GO) build -o $(BIN)/troupe ./cmd/troupe
	$(GO) build -o $(BIN)/pingpong ./samples/pingpong
	$(GO) build -o $(BIN)/jacobi3d ./samples/jacobi3d
	$(GO) build -o $(BIN)/faces ./samples/faces
	$(GO) build -o $(BIN)/protobench ./samples/protobench

# run: the main job, Jacobi3D on four ranks through the embedded launcher: a
# 48^3 grid in 4x4x4 blocks (an actor array, 16 blocks per rank), 10 warm-up +
# 100 timed sweeps, checked bit for bit against a serial reference on rank 0.
run: build
	$(BIN)/troupe run -n 4 --tls shm --procs split -- $(BIN)/jacobi3d -grid 48 -blocks 4x4x4 -iters 100

# test: vet, then every package under the race detector (real UCX between real
# processes for the transport and integration packages), then the actor flood
# at full size (1,000,000 messages) without the race detector, where it judges
# the receiving rank's RSS, Jacobi3D's one-block timing check without it too
# (under the race detector the scheduler hides what it checks), and a short
# run of each fuzz target on top of its committed seed corpus (testdata/fuzz
# of actor, transport and transport/bootstrap; FuzzCMADesc, FuzzRemoteKey and
# FuzzDeviceRejectedHeader only run their seeds, in the race run). The fuzz
# runs are bounded by an
# execution count, not a duration: a duration races Go's fuzz coordinator on a
# loaded machine and fails with "context deadline exceeded" and no crasher
# (golang/go#75804).
test: deps test-deps
	$(GO) vet ./...
	$(GO) test -run '^$$' -fuzz '^FuzzDecodeEnvelope$$' -fuzztime 50000x ./actor/
	$(GO) test -run '^$$' -fuzz '^FuzzEnvelopeShort$$' -fuzztime 50000x ./actor/
	$(GO) test -run '^$$' -fuzz '^FuzzValidateMsgpack$$' -fuzztime 30000x ./actor/
	$(GO) test -run '^$$' -fuzz '^FuzzDecodeBody$$' -fuzztime 20000x ./actor/
	$(GO) test -run '^$$' -fuzz '^FuzzFastDecode$$' -fuzztime 20000x ./actor/
	$(GO) test -run '^$$' -fuzz '^FuzzCreditHeader$$' -fuzztime 5000x ./actor/
	$(GO) test -run '^$$' -fuzz '^FuzzDeviceReplyHeader$$' -fuzztime 5000x ./actor/
	$(GO) test -run '^$$' -fuzz '^FuzzBundleFrames$$' -fuzztime 50000x ./transport/
	$(GO) test -run '^$$' -fuzz '^FuzzRTSDecode$$' -fuzztime 5000x ./transport/
	$(GO) test -run '^$$' -fuzz '^FuzzCTSDecode$$' -fuzztime 5000x ./transport/
	$(GO) test -run '^$$' -fuzz '^FuzzKeyBlob$$' -fuzztime 5000x ./transport/
	$(GO) test -run '^$$' -fuzz '^FuzzIPCDesc$$' -fuzztime 5000x ./transport/
	$(GO) test -run '^$$' -fuzz '^FuzzHostInfo$$' -fuzztime 5000x ./transport/
	$(GO) test -run '^$$' -fuzz '^FuzzReadFrame$$' -fuzztime 5000x ./transport/bootstrap/
	UCX_LOG_LEVEL=error $(GO) test -count=1 -run '^TestActorFlood$$' ./integration/
	$(GO) test -count=1 -run '^TestOneBlockOneProcessor$$' ./samples/jacobi3d/jacobi/
	UCX_LOG_LEVEL=error $(GO) test -race -count=1 -timeout 20m $(RACE_PKGS)

# test-deps installs what only the tests need: Open MPI's mpirun, whose PMIx
# server the PMIx bootstrap is tested against (integration TestPMIxLaunch),
# PMIx's headers, against which TestPMIxABI checks the declarations of
# transport/bootstrap/pmix.go, and Open MPI's headers, with which
# TestMPIReference builds the MPI Jacobi3D (openmpi-bin alone installs
# mpicc.openmpi without mpi.h).
test-deps:
	@if ! command -v mpirun.openmpi >/dev/null 2>&1 || ! pkg-config --exists pmix 2>/dev/null || ! pkg-config --exists ompi-c 2>/dev/null; then \
		echo "installing openmpi-bin libpmix-dev libopenmpi-dev"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libpmix-dev libopenmpi-dev >/dev/null; \
	fi

bench: build
	$(BIN)/troupe bench pingpong --compare 5
	$(BIN)/troupe bench ddt

# bench-mpi: troupe's pack/unpack against Open MPI's and MPICH's MPI_Pack and
# MPI_Unpack on the same layouts, machine and moment (installs both MPIs).
MPIREF := datatype/layouts/mpiref/mpi_pack.c
bench-mpi: build
	@if ! command -v mpicc.openmpi >/dev/null 2>&1 || ! command -v mpicc.mpich >/dev/null 2>&1; then \
		echo "installing libopenmpi-dev libmpich-dev"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenmpi-dev libmpich-dev >/dev/null; \
	fi
	mpicc.openmpi -O2 -o $(BIN)/mpi_pack-openmpi $(MPIREF)
	mpicc.mpich -O2 -o $(BIN)/mpi_pack-mpich $(MPIREF)
	$(BIN)/troupe bench ddt --repeat 3 --mpi $(BIN)/mpi_pack-openmpi,$(BIN)/mpi_pack-mpich

# bench-jacobi-mpi: troupe's Jacobi3D against the same problem written with
# MPI (samples/jacobi3d/mpiref/jacobi3d_mpi.c), built with Open MPI and with
# MPICH, on 1, 2 and 4 ranks (installs both MPIs).
bench-jacobi-mpi: build
	@if ! command -v mpicc.openmpi >/dev/null 2>&1 || ! command -v mpicc.mpich >/dev/null 2>&1; then \
		echo "installing libopenmpi-dev libmpich-dev"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenmpi-dev libmpich-dev >/dev/null; \
	fi
	samples/jacobi3d/mpiref/compare.sh

# ptx regenerates the committed PTX of the CUDA kernels (*.cu next to *.ptx)
# with clang (installs Debian's clang); the tests check it when clang is
# there (internal/cudatest).
ptx: deps
	@command -v clang >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null; }
	TROUPE_UPDATE_PTX=1 $(GO) test -count=1 -run 'PTXUpToDate' ./gpu/ ./gpupack/ ./samples/jacobi3d/jacobi/

clean:
	rm -rf $(BIN)
