//go:build unix

package bootstrap

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"
)

// Launcher defaults.
const (
	DefaultTailLines = 20
	DefaultGrace     = 5 * time.Second
	// outputDrain bounds how long the launcher waits, after a rank exited,
	// for the end of its output once what its pipes held has been read (a
	// descendant that escaped the rank's process group may keep the pipe
	// open, and write to it). The rank's own output is passed on whole,
	// however slowly it is consumed.
	outputDrain = 2 * time.Second
)

// LaunchConfig describes a job for Launch.
type LaunchConfig struct {
	N       int      // number of ranks, >= 1
	Program string   // looked up in PATH like a shell would
	Args    []string // arguments after the program name
	Env     []string // extra KEY=VALUE entries on top of the launcher's environment
	// TLS selects UCX transports: "" leaves UCX_TLS alone, "shm" sets
	// "self,sm", "tcp" sets "self,tcp", anything else is used verbatim.
	TLS string
	// ProcsPerRank sets GOMAXPROCS in every rank: 0 leaves it to Go (each
	// rank then uses all the CPUs the launcher may use, or what GOMAXPROCS
	// in the environment says), n > 0 gives each rank n, and ProcsSplit
	// divides the launcher's own GOMAXPROCS evenly among the ranks, at
	// least one each (SplitProcs). A value set here overrides GOMAXPROCS
	// in the environment.
	ProcsPerRank int
	// Stdout and Stderr receive the ranks' output line by line, prefixed
	// "[rank] " (default os.Stdout, os.Stderr). Stderr also gets the
	// launcher's failure report. They may be the same writer.
	Stdout, Stderr io.Writer
	// TailLines is how many output lines per rank are kept for the failure
	// report (default DefaultTailLines, at most MaxTailLines; negative:
	// none).
	TailLines int
	// Grace is the time between SIGTERM and SIGKILL when stopping ranks
	// (default DefaultGrace).
	Grace time.Duration
	Log   *zap.Logger // nil: no logging
}

// MaxTailLines bounds LaunchConfig.TailLines: the launcher keeps that many
// lines of every rank's output (each up to 1 MiB) for as long as it runs.
const MaxTailLines = 10000

// MaxLocalRanks bounds the ranks of a job the embedded launcher starts
// (and its rendezvous serves): they are processes of this one machine.
const MaxLocalRanks = 1 << 16

// MaxProcsPerRank bounds LaunchConfig.ProcsPerRank: Go ignores a
// GOMAXPROCS beyond int32, and gives every P of a smaller huge one its
// structures at start-up.
const MaxProcsPerRank = 1 << 16

// ProcsSplit is LaunchConfig.ProcsPerRank's value for "divide this
// process's processors among the ranks".
const ProcsSplit = -1

// SplitProcs returns the GOMAXPROCS each of n ranks gets when procs
// processors are divided among them: procs/n, at least 1.
func SplitProcs(procs, n int) int {
	if n < 1 {
		return max(procs, 1)
	}
	return max(procs/n, 1)
}

// gomaxprocs returns the GOMAXPROCS entry for cfg's ranks, or "" to leave
// it alone.
func gomaxprocs(cfg LaunchConfig) (string, error) {
	switch {
	case cfg.ProcsPerRank == 0:
		return "", nil
	case cfg.ProcsPerRank == ProcsSplit:
		return fmt.Sprintf("GOMAXPROCS=%d", SplitProcs(runtime.GOMAXPROCS(0), cfg.N)), nil
	case cfg.ProcsPerRank > 0 && cfg.ProcsPerRank <= MaxProcsPerRank:
		return fmt.Sprintf("GOMAXPROCS=%d", cfg.ProcsPerRank), nil
	}
	return "", fmt.Errorf("bootstrap: processors per rank must be 1 to %d, 0 (Go's default) or ProcsSplit, got %d", MaxProcsPerRank, cfg.ProcsPerRank)
}

// EnvSpin is the actor runtime's TROUPE_SPIN (actor.EnvSpin): how long a
// rank's progress goroutine polls after its last activity before it sleeps.
const EnvSpin = "TROUPE_SPIN"

// OversubscribedSpin is the TROUPE_SPIN the launcher gives the ranks of a
// job with more ranks than it has processors, unless the environment sets
// one. A rank that polls takes the processor another rank needs for its
// computation; as Open MPI yields when oversubscribed, troupe's ranks then
// poll briefly and sleep. Jacobi3D, four ranks on two cores, grid 48: 0.90-
// 1.13 ms a sweep against 1.6-1.8 ms with the actor runtime's default 200 µs
// (docs/launcher.md).
const OversubscribedSpin = 10 * time.Microsecond

// spinEnv returns the TROUPE_SPIN entry for a job of n ranks launched with
// procs processors and environment env, or "" to leave it alone.
func spinEnv(n, procs int, env []string) string {
	if n <= procs {
		return ""
	}
	for _, e := range env {
		if strings.HasPrefix(e, EnvSpin+"=") {
			return ""
		}
	}
	return fmt.Sprintf("%s=%dus", EnvSpin, OversubscribedSpin.Microseconds())
}

// UCXTLS maps a --tls value to UCX_TLS: "shm" -> "self,sm" (UCX's sm alias
// covers posix, sysv and cma), "tcp" -> "self,tcp", "" -> "" (UCX's
// default), anything else verbatim.
func UCXTLS(tls string) string {
	switch tls {
	case "shm":
		return "self,sm"
	case "tcp":
		return "self,tcp"
	default:
		return tls
	}
}

// RankFailure is returned by Launch when a rank exits with a non-zero status
// or is killed by a signal (the first such rank; the others were stopped).
type RankFailure struct {
	Rank       int
	Pid        int
	ExitCode   int            // the exit status, or -1 if killed by a signal
	Signal     syscall.Signal // the signal that killed the rank, 0 if it exited
	CoreDumped bool
	Tail       []string // the rank's last output lines (stdout and stderr), unprefixed
}

// Status describes how the rank ended: "exited with status 3" or
// "killed by signal 9 (killed)".
func (e *RankFailure) Status() string {
	if e.Signal != 0 {
		s := fmt.Sprintf("killed by signal %d (%v)", int(e.Signal), e.Signal)
		if e.CoreDumped {
			s += ", core dumped"
		}
		return s
	}
	return fmt.Sprintf("exited with status %d", e.ExitCode)
}

func (e *RankFailure) Error() string {
	return fmt.Sprintf("rank %d (pid %d) %s", e.Rank, e.Pid, e.Status())
}

// rankProc is one spawned rank.
type rankProc struct {
	rank  int
	cmd   *exec.Cmd
	pipes []*os.File // read ends of stdout and stderr
	outWG sync.WaitGroup
	// read counts the bytes each pump has read from its pipe (drain).
	read [2]atomic.Int64
	done bool // exited and reaped (main loop only)

	// tail is a ring of the last max output lines: once it is full, the
	// oldest is at next, where the next line goes.
	tmu  sync.Mutex
	tail []string
	next int
	max  int
}

func (rp *rankProc) addTail(line string) {
	if rp.max <= 0 {
		return
	}
	rp.tmu.Lock()
	if len(rp.tail) < rp.max {
		rp.tail = append(rp.tail, line)
	} else {
		rp.tail[rp.next] = line
		rp.next = (rp.next + 1) % rp.max
	}
	rp.tmu.Unlock()
}

// lastLines returns the kept lines, oldest first.
func (rp *rankProc) lastLines() []string {
	rp.tmu.Lock()
	defer rp.tmu.Unlock()
	out := append([]string(nil), rp.tail[rp.next:]...)
	return append(out, rp.tail[:rp.next]...)
}

// signalGroup signals the rank's process group.
func (rp *rankProc) signalGroup(sig syscall.Signal) {
	if rp.cmd.Process == nil {
		return
	}
	syscall.Kill(-rp.cmd.Process.Pid, sig)
}

// drain waits for the end of the rank's output, then closes the pipes.
// When the rank has exited, its own output is what its pipes hold now: once
// the pumps have read that, it is theirs to pass on, however slowly the
// launcher's writers take it (drain waits for them), and closing the pipes
// loses none of it. A pipe still open after idle is held by a descendant
// that escaped the process group, silent or writing: it is closed once
// the pipe's content at the start has been read (seen empty since, or as
// many bytes read as it held then, plus a read in flight).
func (rp *rankProc) drain(idle time.Duration) {
	done := make(chan struct{})
	go func() { rp.outWG.Wait(); close(done) }()
	var target [2]int64
	var drained [2]bool
	for i, p := range rp.pipes {
		n, err := pipeBytes(p)
		if err != nil {
			drained[i] = true // cannot tell: bounded by idle, as without output
			continue
		}
		// Read after the look: a read between them only raises the
		// target; one in flight during the look took bytes the look did
		// not see (at most a pump's buffer).
		target[i] = rp.read[i].Load() + int64(n) + pumpBuffer
	}
	start := time.Now()
	poll := time.NewTicker(drainPoll)
	defer poll.Stop()
	for waiting := true; waiting; {
		select {
		case <-done:
			waiting = false
		case <-poll.C:
			all := true
			for i, p := range rp.pipes {
				if !drained[i] {
					n, err := pipeBytes(p)
					drained[i] = err != nil || n == 0 || rp.read[i].Load() >= target[i]
				}
				all = all && drained[i]
			}
			waiting = !all || time.Since(start) < idle
		}
	}
	for _, p := range rp.pipes {
		p.Close()
	}
	<-done
}

// drainPoll is how often drain looks at a rank's pipes.
const drainPoll = 20 * time.Millisecond

// pumpBuffer is the most a pump reads from its pipe at once.
const pumpBuffer = 64 << 10

// countingReader counts the bytes read from r into n.
type countingReader struct {
	r io.Reader
	n *atomic.Int64
}

func (c countingReader) Read(p []byte) (int, error) {
	k, err := c.r.Read(p)
	c.n.Add(int64(k))
	return k, err
}

// sink serialises prefixed lines from every rank onto the launcher's writers.
type sink struct {
	mu sync.Mutex
}

func (s *sink) write(w io.Writer, b []byte) {
	s.mu.Lock()
	w.Write(b)
	s.mu.Unlock()
}

// maxOutputLine is the longest line of a rank's output passed on whole
// (not counting its newline); a longer one is cut into lines of this
// length (the last piece may be shorter), so that a rank writing without
// newlines cannot make the launcher hold unbounded memory.
const maxOutputLine = 1 << 20

func (s *sink) pump(rp *rankProc, r io.Reader, w io.Writer) {
	defer rp.outWG.Done()
	prefix := fmt.Sprintf("[%d] ", rp.rank)
	br := bufio.NewReaderSize(r, pumpBuffer)
	var line, buf []byte
	emit := func(text []byte) {
		buf = append(buf[:0], prefix...)
		buf = append(buf, text...)
		buf = append(buf, '\n')
		s.write(w, buf)
		rp.addTail(string(text))
	}
	for {
		part, err := br.ReadSlice('\n')
		line = append(line, part...)
		full := errors.Is(err, bufio.ErrBufferFull)
		// A piece is cut only once the line is longer than maxOutputLine
		// without its end: a line of exactly maxOutputLine bytes and its
		// newline is one line (it was cut before its newline, which came
		// out as an empty line of its own).
		text := line
		if !full && bytes.HasSuffix(text, []byte("\n")) {
			// A line ends at \n or \r\n: other carriage returns are
			// the program's (progress bars), and stay.
			text = bytes.TrimSuffix(text[:len(text)-1], []byte("\r"))
		}
		for len(text) > maxOutputLine {
			emit(text[:maxOutputLine])
			text = text[maxOutputLine:]
		}
		switch {
		case !full && len(line) > 0:
			emit(text)
			line = line[:0]
		case len(text) < len(line):
			// Keep the uncut rest (full: text is a suffix of line).
			line = append(line[:0], text...)
		}
		if err != nil && !full {
			return
		}
	}
}

type exitEvent struct {
	rank  int
	state *os.ProcessState
	err   error
}

// Launch runs a job: it starts a rendezvous server with a fresh token, spawns
// cfg.N processes of cfg.Program with TROUPE_RANK, TROUPE_SIZE, TROUPE_RDV and
// TROUPE_TOKEN (and UCX_TLS per cfg.TLS) in their environment, forwards their
// output line by line prefixed "[rank] ", forwards SIGINT and SIGTERM to
// them, and waits for all of them.
//
// Each rank runs in its own process group. When a rank exits with a non-zero
// status or is killed by a signal, Launch writes a report (rank, status, last
// output lines) to cfg.Stderr, stops the other ranks (SIGTERM to their
// process groups, SIGKILL after cfg.Grace) and returns a *RankFailure. When
// ctx ends, the ranks are stopped the same way and ctx.Err() is returned.
// When Launch returns, every rank has been reaped and its process group
// killed.
func Launch(ctx context.Context, cfg LaunchConfig) error {
	if cfg.N < 1 || cfg.N > MaxLocalRanks {
		return fmt.Errorf("bootstrap: need at least one rank and at most %d, got -n %d", MaxLocalRanks, cfg.N)
	}
	if cfg.Program == "" {
		return errors.New("bootstrap: no program to run")
	}
	if cfg.TailLines > MaxTailLines {
		return fmt.Errorf("bootstrap: at most %d tail lines per rank, got %d", MaxTailLines, cfg.TailLines)
	}
	procs, err := gomaxprocs(cfg)
	if err != nil {
		return err
	}
	if cfg.Stdout == nil {
		cfg.Stdout = os.Stdout
	}
	if cfg.Stderr == nil {
		cfg.Stderr = os.Stderr
	}
	if cfg.TailLines == 0 {
		cfg.TailLines = DefaultTailLines
	}
	if cfg.Grace <= 0 {
		cfg.Grace = DefaultGrace
	}
	log := cfg.Log
	if log == nil {
		log = zap.NewNop()
	}
	path, err := exec.LookPath(cfg.Program)
	if err != nil {
		return fmt.Errorf("bootstrap: %w", err)
	}

	token, err := NewToken()
	if err != nil {
		return err
	}
	srv, err := NewServer(cfg.N, token, log)
	if err != nil {
		return err
	}
	defer srv.Close()

	env := append(os.Environ(), cfg.Env...)
	if tls := UCXTLS(cfg.TLS); tls != "" {
		env = append(env, "UCX_TLS="+tls)
	}
	if procs != "" {
		env = append(env, procs) // the last entry of a name wins (os/exec)
	}
	if spin := spinEnv(cfg.N, runtime.GOMAXPROCS(0), env); spin != "" {
		env = append(env, spin)
	}
	env = append(env,
		EnvSize+"="+fmt.Sprint(cfg.N),
		EnvRdv+"="+srv.Addr(),
		EnvToken+"="+token.String(),
	)

	// Forward SIGINT/SIGTERM from now on.
	sigc := make(chan os.Signal, 8)
	signal.Notify(sigc, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigc)

	out := &sink{}
	ranks := make([]*rankProc, cfg.N)
	exits := make(chan exitEvent, cfg.N)

	// Spawn from one goroutine locked to its OS thread, kept alive until
	// Launch returns: Pdeathsig fires when the spawning thread exits, so the
	// thread must outlive the ranks.
	spawned := make(chan error, 1)
	release := make(chan struct{})
	defer close(release)
	go func() {
		runtime.LockOSThread()
		spawned <- spawnAll(cfg, path, env, ranks, out, exits, log)
		<-release
		runtime.UnlockOSThread()
	}()
	if err := <-spawned; err != nil {
		// Stop what was started, reap it, and report the spawn error.
		n := 0
		for _, rp := range ranks {
			if rp != nil {
				rp.signalGroup(syscall.SIGKILL)
				n++
			}
		}
		for range n {
			ev := <-exits
			ranks[ev.rank].signalGroup(syscall.SIGKILL)
			waitGroupDead(ranks[ev.rank].cmd.Process.Pid, outputDrain)
			ranks[ev.rank].drain(outputDrain)
		}
		return err
	}
	log.Debug("job started", zap.Int("ranks", cfg.N), zap.String("program", path), zap.String("rendezvous", srv.Addr()))

	var (
		failure  *RankFailure
		stopErr  error
		stopping bool
		killC    <-chan time.Time
		ctxDone  = ctx.Done()
		nsig     int
		running  = cfg.N
	)
	say := func(format string, args ...any) { out.write(cfg.Stderr, fmt.Appendf(nil, format, args...)) }
	stopOthers := func(why string) {
		stopping = true
		live := 0
		for _, rp := range ranks {
			if !rp.done {
				rp.signalGroup(syscall.SIGTERM)
				live++
			}
		}
		if live > 0 {
			say("troupe: %s: stopping %d remaining rank(s) (SIGTERM, SIGKILL after %v)\n", why, live, cfg.Grace)
			killC = time.After(cfg.Grace)
		}
	}
	for running > 0 {
		select {
		case ev := <-exits:
			running--
			rp := ranks[ev.rank]
			rp.done = true
			srv.rankExited(ev.rank)
			// Whatever the rank left behind in its group goes with it.
			rp.signalGroup(syscall.SIGKILL)
			if !waitGroupDead(rp.cmd.Process.Pid, outputDrain) {
				log.Warn("processes left by a rank survived SIGKILL", zap.Int("rank", rp.rank))
			}
			rp.drain(outputDrain)
			ok := ev.err == nil && ev.state != nil && ev.state.Success()
			log.Debug("rank exited", zap.Int("rank", ev.rank), zap.Stringer("state", ev.state), zap.Bool("ok", ok))
			if ok || stopping {
				continue
			}
			failure = newRankFailure(rp, ev)
			out.write(cfg.Stderr, []byte(report(failure)))
			log.Info("rank failed", zap.Int("rank", failure.Rank), zap.String("status", failure.Status()))
			stopOthers(fmt.Sprintf("rank %d failed", failure.Rank))
		case sig := <-sigc:
			nsig++
			s := sig.(syscall.Signal)
			if nsig > 1 {
				s = syscall.SIGKILL // asked twice: no more patience
			}
			say("troupe: got %v, forwarding %v to %d rank(s)\n", sig, s, running)
			for _, rp := range ranks {
				if !rp.done {
					rp.signalGroup(s)
				}
			}
			if !stopping {
				stopping = true
				stopErr = fmt.Errorf("bootstrap: interrupted by %v", sig)
				killC = time.After(cfg.Grace)
			}
		case <-ctxDone:
			ctxDone = nil
			if !stopping {
				stopErr = ctx.Err()
				stopOthers(ctx.Err().Error())
			}
		case <-killC:
			killC = nil
			for _, rp := range ranks {
				if !rp.done {
					log.Debug("rank did not stop in time, killing it", zap.Int("rank", rp.rank))
					rp.signalGroup(syscall.SIGKILL)
				}
			}
		}
	}
	if failure != nil {
		return failure
	}
	return stopErr
}

// spawnAll starts every rank; on error the ranks already started are in ranks.
func spawnAll(cfg LaunchConfig, path string, env []string, ranks []*rankProc, out *sink, exits chan<- exitEvent, log *zap.Logger) error {
	for r := range cfg.N {
		rp := &rankProc{rank: r, max: cfg.TailLines}
		cmd := exec.Command(path, cfg.Args...)
		cmd.Args[0] = cfg.Program
		cmd.Env = append(env[:len(env):len(env)], EnvRank+"="+fmt.Sprint(r))
		cmd.SysProcAttr = rankProcAttr()
		rp.cmd = cmd

		var writers []*os.File
		closeAll := func() {
			for _, f := range append(writers, rp.pipes...) {
				f.Close()
			}
		}
		for range 2 {
			pr, pw, err := os.Pipe()
			if err != nil {
				closeAll()
				return fmt.Errorf("bootstrap: rank %d: %w", r, err)
			}
			rp.pipes = append(rp.pipes, pr)
			writers = append(writers, pw)
		}
		cmd.Stdout, cmd.Stderr = writers[0], writers[1]
		if err := cmd.Start(); err != nil {
			closeAll()
			return fmt.Errorf("bootstrap: starting rank %d: %w", r, err)
		}
		for _, w := range writers {
			w.Close()
		}
		ranks[r] = rp
		rp.outWG.Add(2)
		go out.pump(rp, countingReader{rp.pipes[0], &rp.read[0]}, cfg.Stdout)
		go out.pump(rp, countingReader{rp.pipes[1], &rp.read[1]}, cfg.Stderr)
		go func() {
			err := cmd.Wait()
			exits <- exitEvent{rank: r, state: cmd.ProcessState, err: ignoreExitError(err)}
		}()
		log.Debug("rank started", zap.Int("rank", r), zap.Int("pid", cmd.Process.Pid))
	}
	return nil
}

func ignoreExitError(err error) error {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return nil
	}
	return err
}

func newRankFailure(rp *rankProc, ev exitEvent) *RankFailure {
	f := &RankFailure{Rank: rp.rank, Pid: rp.cmd.Process.Pid, ExitCode: -1, Tail: rp.lastLines()}
	if ev.state != nil {
		f.ExitCode = ev.state.ExitCode()
		if ws, ok := ev.state.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			f.Signal = ws.Signal()
			f.CoreDumped = ws.CoreDump()
		}
	}
	return f
}

// report formats the failure report written to the launcher's stderr.
func report(f *RankFailure) string {
	var b strings.Builder
	fmt.Fprintf(&b, "troupe: rank %d (pid %d) %s", f.Rank, f.Pid, f.Status())
	if len(f.Tail) == 0 {
		b.WriteString("; no output kept\n")
	} else {
		fmt.Fprintf(&b, "; its last %d line(s):\n", len(f.Tail))
		for _, l := range f.Tail {
			fmt.Fprintf(&b, "  [%d] %s\n", f.Rank, l)
		}
	}
	return b.String()
}
