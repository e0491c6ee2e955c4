package bootstrap

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
)

// Environment variables set by the launcher for every rank.
const (
	EnvRank  = "TROUPE_RANK"  // this process's rank, 0-based
	EnvSize  = "TROUPE_SIZE"  // number of ranks in the job
	EnvRdv   = "TROUPE_RDV"   // host:port of the rendezvous service
	EnvToken = "TROUPE_TOKEN" // job token, 32 hex digits
)

// PMIx joins a job through the PMIx server of the launcher that started
// this process (mpirun, prterun, srun --mpi=pmix), exchanging values with
// PMIx put/commit/fence/get. FromEnv calls it when the process was not
// started by troupe run (no TROUPE_RDV) but a PMIx server is advertised
// (PMIX_RANK or PMIX_SERVER_URI* in the environment). It is the dlopen
// backend of pmix.go in builds with cgo on linux, nil in others; a program
// may replace it.
var PMIx func(ctx context.Context) (Bootstrapper, error)

// launcherRankVars are the rank/size variables of common launchers, tried in
// order when TROUPE_RANK/TROUPE_SIZE are absent but TROUPE_RDV and
// TROUPE_TOKEN are set (a rendezvous started by hand, ranks started by
// mpirun or srun without PMIx).
var launcherRankVars = [][2]string{
	{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
	{"PMI_RANK", "PMI_SIZE"},
	{"PMIX_RANK", "PMIX_SIZE"}, // PMIX_SIZE is not standard: the pair is used only when both are set
	{"SLURM_PROCID", "SLURM_NTASKS"},
}

// pmixAdvertised reports whether the environment looks like a PMIx launch.
func pmixAdvertised() bool {
	for _, v := range []string{"PMIX_RANK", "PMIX_SERVER_URI41", "PMIX_SERVER_URI4", "PMIX_SERVER_URI3", "PMIX_SERVER_URI21", "PMIX_SERVER_URI2"} {
		if os.Getenv(v) != "" {
			return true
		}
	}
	return false
}

// FromEnv joins the job this process belongs to, as described by its
// environment:
//
//  1. TROUPE_RANK, TROUPE_SIZE, TROUPE_RDV, TROUPE_TOKEN (set by troupe run):
//     the rendezvous client.
//  2. TROUPE_RDV and TROUPE_TOKEN but no TROUPE_RANK/TROUPE_SIZE: rank and size
//     from OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE, or SLURM_PROCID/NTASKS.
//  3. No TROUPE_RDV but a PMIx environment: the PMIx backend (PMIx).
//
// Otherwise it returns an error explaining how to start the program.
func FromEnv(ctx context.Context) (Bootstrapper, error) {
	rdv, tok := os.Getenv(EnvRdv), os.Getenv(EnvToken)
	if rdv == "" {
		if pmixAdvertised() {
			if PMIx != nil {
				return PMIx(ctx)
			}
			return nil, errors.New("bootstrap: started under a PMIx launcher, but this build has no PMIx support (it needs cgo on linux); " +
				"start the job with `troupe run -n N -- PROGRAM`")
		}
		return nil, fmt.Errorf("bootstrap: %s is not set: not started by troupe run? "+
			"start the job with `troupe run -n N -- PROGRAM ARGS` (it sets %s, %s, %s and %s)",
			EnvRdv, EnvRank, EnvSize, EnvRdv, EnvToken)
	}
	if tok == "" {
		return nil, fmt.Errorf("bootstrap: %s is set but %s is not: not started by troupe run?", EnvRdv, EnvToken)
	}
	token, err := ParseToken(tok)
	if err != nil {
		return nil, fmt.Errorf("bootstrap: %s: %w", EnvToken, err)
	}
	rank, size, err := rankSizeFromEnv()
	if err != nil {
		return nil, err
	}
	return Dial(ctx, rdv, token, rank, size)
}

func rankSizeFromEnv() (rank, size int, err error) {
	pairs := append([][2]string{{EnvRank, EnvSize}}, launcherRankVars...)
	for _, p := range pairs {
		rs, ss := os.Getenv(p[0]), os.Getenv(p[1])
		if rs == "" && ss == "" {
			continue
		}
		if p[0] == "PMIX_RANK" && ss == "" {
			continue // srun --mpi=pmix sets PMIX_RANK alone: SLURM_* follow
		}
		if rs == "" || ss == "" {
			return 0, 0, fmt.Errorf("bootstrap: %s and %s must be set together (got %s=%q, %s=%q)", p[0], p[1], p[0], rs, p[1], ss)
		}
		if rank, err = strconv.Atoi(rs); err != nil {
			return 0, 0, fmt.Errorf("bootstrap: %s=%q is not an integer", p[0], rs)
		}
		if size, err = strconv.Atoi(ss); err != nil {
			return 0, 0, fmt.Errorf("bootstrap: %s=%q is not an integer", p[1], ss)
		}
		if size < 1 || rank < 0 || rank >= size {
			return 0, 0, fmt.Errorf("bootstrap: %s=%d out of range for %s=%d", p[0], rank, p[1], size)
		}
		return rank, size, nil
	}
	return 0, 0, fmt.Errorf("bootstrap: %s and %s are not set: not started by troupe run? "+
		"start the job with `troupe run -n N -- PROGRAM ARGS`", EnvRank, EnvSize)
}
