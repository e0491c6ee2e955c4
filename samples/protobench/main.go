// Command protobench measures protoactor-go's own gRPC remote between two
// processes on this machine, for comparison with troupe's actor runtime
// (troupe bench actor). It reports an 8 B request/response round trip and
// one-way throughput for 64 B, 64 KiB and 1 MiB messages.
//
// One command, the server started as a child process:
//
//	protobench -selfspawn [--json]
//
// Or the two sides by hand:
//
//	protobench -role server -addr 127.0.0.1:9000
//	protobench -role client -addr 127.0.0.1:0 -peer 127.0.0.1:9000 [--json]
package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/troupe-hpc/troupe/samples/protobench/bench"
)

// childEnv marks a process started by -selfspawn; tests use it to tell
// their re-executed binary to act as the server.
const childEnv = "PROTOBENCH_CHILD"

func main() {
	os.Exit(exitStatus(run(os.Args[1:], os.Stdin, os.Stdout), os.Stderr))
}

// exitStatus prints run's error and returns the exit status: 0 without an
// error and after -h, 2 for a bad command line, 1 for another error.
func exitStatus(err error, stderr io.Writer) int {
	var usage *usageError
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &usage):
		fmt.Fprintln(stderr, "protobench:", err)
		return 2
	default:
		fmt.Fprintln(stderr, "protobench:", err)
		return 1
	}
}

// usageError is a bad command line (exit status 2).
type usageError struct{ err error }

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

// options are the parsed command line.
type options struct {
	role      string
	addr      string
	peer      string
	selfspawn bool
	jsonOut   bool
	stdinEOF  bool
	cfg       bench.Config
}

func parse(args []string) (options, error) {
	var o options
	fs := flag.NewFlagSet("protobench", flag.ContinueOnError)
	def := bench.DefaultConfig("")
	fs.StringVar(&o.role, "role", "", "server or client (not needed with -selfspawn)")
	fs.StringVar(&o.addr, "addr", "127.0.0.1:0", "server: address to listen on (port 0 picks one); client and -selfspawn: host:port whose host the client's remotes listen on (the port is picked)")
	fs.StringVar(&o.peer, "peer", "", "client: address of the server")
	fs.BoolVar(&o.selfspawn, "selfspawn", false, "start the server as a child process and run the client against it")
	fs.BoolVar(&o.jsonOut, "json", false, "print one JSON object per row instead of a table")
	fs.BoolVar(&o.stdinEOF, "stdin-eof", false, "server: exit when stdin reaches end of file")
	fs.IntVar(&o.cfg.RTTSize, "rtt-size", def.RTTSize, "rtt payload in bytes")
	fs.IntVar(&o.cfg.RTTWarmup, "warmup", def.RTTWarmup, "untimed round trips before the timed ones")
	fs.IntVar(&o.cfg.RTTIters, "iters", def.RTTIters, "timed round trips (0 skips rtt)")
	sizes := fs.String("sizes", "64,65536,1048576", "comma-separated tput payload sizes in bytes (empty skips tput)")
	fs.Int64Var(&o.cfg.TputBytes, "bytes", def.TputBytes, "tput: bytes to send per size (count = bytes/size, clamped to -min-msgs..-max-msgs)")
	fs.IntVar(&o.cfg.TputMinMsgs, "min-msgs", def.TputMinMsgs, "tput: fewest messages per size")
	fs.IntVar(&o.cfg.TputMaxMsgs, "max-msgs", def.TputMaxMsgs, "tput: most messages per size")
	fs.IntVar(&o.cfg.MaxBatchBytes, "batch-bytes", def.MaxBatchBytes, "cap the client's endpoint writer batch at this many payload bytes")
	fs.DurationVar(&o.cfg.Timeout, "timeout", def.Timeout, "limit for one round, and for the server to answer first")
	fs.BoolVar(&o.cfg.Verbose, "v", false, "let protoactor log to stderr")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return o, err
		}
		return o, &usageError{err}
	}
	if fs.NArg() > 0 {
		// The flag package stops at the first argument that is not a
		// flag: every flag after it would be ignored.
		return o, &usageError{fmt.Errorf("unexpected argument %q (protobench takes flags only; see -h)", fs.Arg(0))}
	}
	o.cfg.Host = def.Host
	for _, s := range strings.Split(*sizes, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		n, err := strconv.Atoi(s)
		if err != nil || n <= 0 {
			return o, &usageError{fmt.Errorf("bad -sizes entry %q", s)}
		}
		o.cfg.TputSizes = append(o.cfg.TputSizes, n)
	}
	return o, nil
}

func run(args []string, stdin io.Reader, stdout io.Writer) error {
	o, err := parse(args)
	if err != nil {
		return err
	}
	switch {
	case o.selfspawn:
		return runSelfSpawn(o, stdout)
	case o.role == "server":
		return runServer(o, stdin, stdout)
	case o.role == "client":
		if o.peer == "" {
			return fmt.Errorf("-role client needs -peer (the server's address)")
		}
		return runClient(o, o.peer, stdout)
	default:
		return fmt.Errorf("give -selfspawn, or -role server / -role client")
	}
}

// runServer serves until SIGINT/SIGTERM or, with -stdin-eof, stdin's end.
func runServer(o options, stdin io.Reader, stdout io.Writer) error {
	srv, err := bench.StartServer(o.addr, o.cfg.Verbose)
	if err != nil {
		return err
	}
	defer srv.Stop()
	fmt.Fprintf(stdout, "%s%s\n", bench.ReadyPrefix, srv.Addr())

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sig)
	eof := make(chan struct{})
	if o.stdinEOF {
		go func() {
			io.Copy(io.Discard, bufio.NewReader(stdin))
			close(eof)
		}()
	}
	select {
	case <-sig:
	case <-eof:
	}
	return nil
}

func runClient(o options, peer string, stdout io.Writer) error {
	host, _, err := splitHost(o.addr)
	if err != nil {
		return err
	}
	o.cfg.Server = peer
	o.cfg.Host = host
	rows, err := bench.Run(o.cfg)
	if err != nil {
		return err
	}
	if o.jsonOut {
		return bench.WriteJSON(stdout, rows)
	}
	return bench.WriteTable(stdout, rows)
}

func splitHost(addr string) (string, string, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", "", fmt.Errorf("parse -addr %q: %w", addr, err)
	}
	return host, port, nil
}

// runSelfSpawn re-executes this binary as the server and runs the client.
func runSelfSpawn(o options, stdout io.Writer) error {
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find own executable: %w", err)
	}
	host, _, err := splitHost(o.addr)
	if err != nil {
		return err
	}
	args := []string{"-role", "server", "-addr", host + ":0", "-stdin-eof"}
	if o.cfg.Verbose {
		args = append(args, "-v")
	}
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), childEnv+"=1")
	child, err := bench.SpawnServer(cmd, 30*time.Second)
	if err != nil {
		return err
	}
	runErr := runClient(o, child.Addr(), stdout)
	stopErr := child.Stop()
	if runErr != nil {
		return runErr
	}
	return stopErr
}
