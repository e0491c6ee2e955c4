package integration

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/actor"
)

// Message types of the actor scenarios. Every rank is this same binary, so
// every rank registers the same types (as the runtime requires).
type (
	// aPing asks an echo actor for an aPong with N+1 and its rank.
	aPing struct{ N int }
	aPong struct{ N, From int }
	// seqMsg is one message of an ordered stream: small, or with a large
	// Text (a rendezvous body) or a large out-of-band Payload.
	seqMsg struct {
		From, N int
		Text    string
		Data    actor.Payload
	}
	// seqDone asks a sink whether From's stream of Count messages arrived
	// complete and in order; the answer is a verdict.
	seqDone struct{ From, Count int }
	verdict struct{ Err string }
	// hold is a request the victim of the kill scenario never answers.
	hold struct{ N int }
	// tick is one message of the flood.
	tick struct{ From, N int }
	// notRegistered is never registered: sending it anywhere must fail.
	notRegistered struct{ X int }
)

func init() {
	actor.MustRegister[aPing]()
	actor.MustRegister[aPong]()
	actor.MustRegister[seqMsg]()
	actor.MustRegister[seqDone]()
	actor.MustRegister[verdict]()
	actor.MustRegister[hold]()
	actor.MustRegister[tick]()
}

// actorTimeout bounds waits that only a broken runtime makes long (a
// liveness limit on a slow shared machine, not a performance target).
const actorTimeout = 20 * time.Second

// withActors starts this rank's actor runtime on the scenario's transport
// (the scenario picked UCX_TLS), runs f, and shuts the runtime down.
func withActors(ctx context.Context, r *rank, opts actor.Options, f func(rt *actor.Runtime) error) error {
	opts.Transport = r.t
	rt, err := actor.Init(ctx, opts)
	if err != nil {
		return fmt.Errorf("actor.Init: %w", err)
	}
	ferr := f(rt)
	if ferr == nil {
		// Shutdown is collective, but a rank in it no longer sends: no
		// rank starts it while another may still request from its actors.
		ferr = r.b.Barrier(ctx, "actors.done")
	}
	sctx, cancel := context.WithTimeout(context.Background(), actorTimeout)
	defer cancel()
	if err := rt.Shutdown(sctx); err != nil && ferr == nil {
		ferr = fmt.Errorf("Shutdown: %w", err)
	}
	return ferr
}

// spawn spawns a named actor with the runtime's Props (credits come back
// after processing).
func spawn(rt *actor.Runtime, name string, f pa.ReceiveFunc) (*pa.PID, error) {
	pid, err := rt.Root().SpawnNamed(rt.PropsFromFunc(f), name)
	if err != nil {
		return nil, fmt.Errorf("spawning %s: %w", name, err)
	}
	return pid, nil
}

// echo answers aPing with aPong.
func echo(rt *actor.Runtime) pa.ReceiveFunc {
	return func(c pa.Context) {
		if m, ok := c.Message().(*aPing); ok {
			c.Respond(&aPong{N: m.N + 1, From: rt.Rank()})
		}
	}
}

// ping requests rank p's echo and checks the answer.
func ping(rt *actor.Runtime, p, n int) error {
	res, err := rt.Request(rt.PID(p, "echo"), &aPing{N: n}, actorTimeout)
	if err != nil {
		return fmt.Errorf("request %d to rank %d's echo: %w", n, p, err)
	}
	return checkPong(res, p, n)
}

func checkPong(res any, p, n int) error {
	if pg, ok := res.(*aPong); !ok || pg.N != n+1 || pg.From != p {
		return fmt.Errorf("request %d to rank %d's echo: got %#v, want &aPong{N: %d, From: %d}", n, p, res, n+1, p)
	}
	return nil
}

// watchCmd asks a watcher actor (locally) to watch or unwatch pid.
type watchCmd struct {
	pid     *pa.PID
	unwatch bool
}

// watcher watches what it is told to and hands every Terminated it gets to
// a channel.
type watcher struct{ term chan *pa.Terminated }

func (w *watcher) Receive(c pa.Context) {
	switch m := c.Message().(type) {
	case *watchCmd:
		if m.unwatch {
			c.Unwatch(m.pid)
		} else {
			c.Watch(m.pid)
		}
		c.Respond(true)
	case *pa.Terminated:
		w.term <- m
	}
}

// newWatcher spawns a watcher actor.
func newWatcher(rt *actor.Runtime, name string) (*pa.PID, chan *pa.Terminated, error) {
	w := &watcher{term: make(chan *pa.Terminated, 64)}
	pid, err := rt.Root().SpawnNamed(rt.Props(func() pa.Actor { return w }), name)
	if err != nil {
		return nil, nil, fmt.Errorf("spawning %s: %w", name, err)
	}
	return pid, w.term, nil
}

// command has the watcher at w watch (or unwatch) pid, and waits until it did.
func command(rt *actor.Runtime, w, pid *pa.PID, unwatch bool) error {
	if _, err := rt.Request(w, &watchCmd{pid: pid, unwatch: unwatch}, actorTimeout); err != nil {
		return fmt.Errorf("watcher %s, unwatch=%v %s: %w", w.Id, unwatch, pid, err)
	}
	return nil
}

// samePID compares the actor a PID names (not its request id).
func samePID(a, b *pa.PID) bool {
	return a != nil && b != nil && a.Address == b.Address && a.Id == b.Id
}

// expectTerminated waits up to limit for the next Terminated on ch and
// checks whom it is for and why. It returns how long it waited.
func expectTerminated(ch <-chan *pa.Terminated, who *pa.PID, why pa.TerminatedReason, limit time.Duration) (time.Duration, error) {
	start := time.Now()
	select {
	case m := <-ch:
		if !samePID(m.Who, who) || m.Why != why {
			return time.Since(start), fmt.Errorf("Terminated{Who: %s, Why: %s}, want Terminated{Who: %s, Why: %s}", m.Who, m.Why, who, why)
		}
		return time.Since(start), nil
	case <-time.After(limit):
		return limit, fmt.Errorf("no Terminated for %s (%s) within %v", who, why, limit)
	}
}

// collector gathers failures of actors (which cannot return errors).
type collector struct {
	mu   sync.Mutex
	errs []error
}

func (c *collector) add(format string, args ...any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.errs) < 10 {
		c.errs = append(c.errs, fmt.Errorf(format, args...))
	}
}

func (c *collector) err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return errors.Join(c.errs...)
}

// procStatus reads a "VmRSS:"-style field of /proc/self/status in bytes.
func procStatus(field string) (int64, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), field+":")
		if !ok {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/self/status %s: %w", field, err)
		}
		return kb << 10, nil
	}
	return 0, fmt.Errorf("/proc/self/status has no %s", field)
}

// resetHWM resets VmHWM to the current RSS (Linux >= 4.0); false if it
// could not.
func resetHWM() bool {
	return os.WriteFile("/proc/self/clear_refs", []byte("5"), 0) == nil
}

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }
