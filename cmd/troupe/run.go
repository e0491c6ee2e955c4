package main

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

// runCmd is `troupe run`, the embedded launcher: a thin wrapper over
// bootstrap.Launch (see docs/launcher.md).
var runCmd = newRunCmd()

func init() {
	rootCmd.AddCommand(runCmd)
}

func newRunCmd() *cobra.Command {
	var (
		n     int
		tls   string
		procs string
		tail  int
		grace time.Duration
	)
	cmd := &cobra.Command{
		Use:   "run -n N [--tls shm|tcp|...] [--procs split|K] [--tail K] -- PROGRAM [ARGS...]",
		Short: "Run a job of N ranks on this machine",
		Long: `Run starts a loopback rendezvous service with a fresh job token and spawns N
copies of PROGRAM with TROUPE_RANK, TROUPE_SIZE, TROUPE_RDV and TROUPE_TOKEN in
their environment. Their output is forwarded line by line, prefixed "[rank] ";
SIGINT and SIGTERM are forwarded to them. If a rank exits with a non-zero
status or is killed by a signal, troupe reports which rank, how it ended and
its last output lines, stops the other ranks and exits with status 1.

--tls picks UCX transports: shm (UCX_TLS=self,sm), tcp (UCX_TLS=self,tcp), or
any other value passed verbatim as UCX_TLS.

--procs sets GOMAXPROCS in every rank: split divides the launcher's
processors evenly among the ranks (at least one each), K gives each rank K;
without it every rank gets Go's default (all the CPUs, or GOMAXPROCS from the
environment). Ranks that use the overlap engine want at least two each
(docs/launcher.md). With more ranks than the launcher's processors, ranks get
TROUPE_SPIN=10us (poll briefly, then sleep) unless the environment sets it.
Set TROUPE_LOG=debug for the launcher's and rendezvous's logs.`,
		Example: `  troupe run -n 2 -- ./pingpong
  troupe run -n 4 --tls tcp -- ./jacobi3d -grid 256
  troupe run -n 8 --procs split -- ./jacobi3d`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			log, err := runLogger(os.Getenv("TROUPE_LOG"), cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			defer log.Sync()
			if n < 1 {
				return fmt.Errorf("run: -n must be >= 1, got %d", n)
			}
			if tail < 0 || tail > bootstrap.MaxTailLines {
				return fmt.Errorf("run: --tail must be 0 to %d, got %d", bootstrap.MaxTailLines, tail)
			}
			if grace <= 0 {
				return fmt.Errorf("run: --grace must be > 0, got %v", grace)
			}
			if tail == 0 {
				tail = -1 // Launch reads 0 as "default"
			}
			perRank, err := parseProcs(procs)
			if err != nil {
				return fmt.Errorf("run: %w", err)
			}
			return bootstrap.Launch(cmd.Context(), bootstrap.LaunchConfig{
				N:            n,
				Program:      args[0],
				Args:         args[1:],
				TLS:          tls,
				ProcsPerRank: perRank,
				Stdout:       cmd.OutOrStdout(),
				Stderr:       cmd.ErrOrStderr(),
				TailLines:    tail,
				Grace:        grace,
				Log:          log.Named("launcher"),
			})
		},
	}
	f := cmd.Flags()
	// Everything from PROGRAM on belongs to PROGRAM, with or without "--".
	f.SetInterspersed(false)
	f.IntVarP(&n, "np", "n", 1, "number of ranks")
	f.StringVar(&tls, "tls", "", `UCX transports: "shm", "tcp", or a UCX_TLS value`)
	f.StringVar(&procs, "procs", "", `GOMAXPROCS of each rank: "split" (the launcher's processors divided among the ranks) or a count; unset: Go's default`)
	f.IntVar(&tail, "tail", bootstrap.DefaultTailLines, "output lines of a failed rank to show")
	f.DurationVar(&grace, "grace", bootstrap.DefaultGrace, "time between SIGTERM and SIGKILL when stopping ranks")
	return cmd
}

// parseProcs reads --procs: "" (Go's default), "split" or a count >= 1.
func parseProcs(v string) (int, error) {
	switch v {
	case "":
		return 0, nil
	case "split":
		return bootstrap.ProcsSplit, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > bootstrap.MaxProcsPerRank {
		return 0, fmt.Errorf("--procs must be split or a count >= 1 and <= %d, got %q", bootstrap.MaxProcsPerRank, v)
	}
	return n, nil
}

// procsLabel says what GOMAXPROCS the ranks of an n-rank job get from a
// --procs value, for a benchmark's header.
func procsLabel(v string, n int) string {
	switch v {
	case "":
		return "Go's default"
	case "split":
		return fmt.Sprintf("%d each, split", bootstrap.SplitProcs(runtime.GOMAXPROCS(0), n))
	}
	return v + " each"
}

// runLogger builds the launcher's logger: console lines on w, warn level
// unless TROUPE_LOG names another level (debug, info, warn, error).
func runLogger(level string, w interface{ Write([]byte) (int, error) }) (*zap.Logger, error) {
	lvl := zapcore.WarnLevel
	if level = strings.TrimSpace(level); level != "" {
		l, err := zapcore.ParseLevel(level)
		if err != nil {
			return nil, fmt.Errorf("TROUPE_LOG=%q: %w", level, err)
		}
		lvl = l
	}
	enc := zap.NewDevelopmentEncoderConfig()
	enc.TimeKey = ""
	core := zapcore.NewCore(zapcore.NewConsoleEncoder(enc), zapcore.Lock(zapcore.AddSync(w)), lvl)
	return zap.New(core).Named("troupe"), nil
}
