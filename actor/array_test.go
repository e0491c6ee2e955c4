package actor

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"
)

// reduceAll asks every element to contribute with op to target.
type reduceAll struct {
	Op     string
	Target *pa.PID
	Slice  bool
}

type element struct{ el *Element }

func (e *element) Receive(c pa.Context) {
	if m, ok := c.Message().(*reduceAll); ok {
		var v any = float64(e.el.Linear)
		if m.Slice {
			v = []int64{int64(e.el.Linear), 1}
		}
		if err := e.el.Contribute(v, m.Op, m.Target); err != nil {
			panic(err)
		}
	}
}

func init() {
	MustRegister[reduceAll]()
	if err := RegisterOp("last-wins", func(a, b any) (any, error) { return max(a.(float64), b.(float64)), nil }); err != nil {
		panic(err)
	}
}

func newArrays(t *testing.T, rts []*Runtime, cfg ArrayConfig) []*Array {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	as := make([]*Array, len(rts))
	errs := make(chan error, len(rts))
	for i, rt := range rts {
		go func() {
			var err error
			as[i], err = rt.NewArray(ctx, cfg)
			errs <- err
		}()
	}
	for range rts {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	return as
}

func TestArrayBroadcastAndReductions(t *testing.T) {
	rts := startLocal(t, 3)
	for _, place := range []struct {
		name string
		p    Placement
	}{{"block", Block}, {"roundrobin", RoundRobin}} {
		cfg := ArrayConfig{Name: "a-" + place.name, Dims: []int{4, 5}, Placement: place.p,
			New: func(el *Element) pa.Actor { return &element{el: el} }}
		as := newArrays(t, rts, cfg)
		n := as[0].Len()
		if n != 20 {
			t.Fatalf("len %d", n)
		}
		total := 0
		for r := range rts {
			total += as[0].LocalCount(r)
			if got := len(as[r].Local()); got != as[0].LocalCount(r) {
				t.Fatalf("rank %d hosts %d elements, placement says %d", r, got, as[0].LocalCount(r))
			}
		}
		if total != n {
			t.Fatalf("placement covers %d of %d", total, n)
		}
		if r := as[1].RankOf(3, 4); r != place.p(Index{3, 4}, 19, []int{4, 5}, 3) {
			t.Fatalf("RankOf(3,4) = %d", r)
		}
		for _, tc := range []struct {
			op    string
			slice bool
			want  any
			err   string // the round fails with this in its error
		}{
			{Sum, false, float64(n * (n - 1) / 2), ""},
			{Min, false, float64(0), ""},
			// A user op that panics (last-wins asserts float64) fails its
			// round; the rounds after it are whole.
			{"last-wins", true, nil, `op "last-wins" panicked`},
			{Max, false, float64(n - 1), ""},
			{"last-wins", false, float64(n - 1), ""},
			{Sum, true, []int64{int64(n * (n - 1) / 2), int64(n)}, ""},
		} {
			f := pa.NewFuture(rts[0].System(), 10*time.Second)
			// Broadcast from rank 2; the result goes to a future on rank 0.
			if err := as[2].Broadcast(&reduceAll{Op: tc.op, Target: f.PID(), Slice: tc.slice}); err != nil {
				t.Fatal(err)
			}
			res, err := f.Result()
			if err != nil {
				t.Fatalf("%s %s: %v", place.name, tc.op, err)
			}
			red, ok := res.(*Reduced)
			if !ok {
				t.Fatalf("%s %s: got %T", place.name, tc.op, res)
			}
			v, err := red.Result()
			if tc.err != "" {
				if !errors.Is(err, ErrReduce) || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("%s %s: %v %v, want an ErrReduce saying %s", place.name, tc.op, v, err, tc.err)
				}
				continue
			}
			if err != nil {
				t.Fatal(err)
			}
			if !equalValues(v, tc.want) {
				t.Fatalf("%s %s: got %v, want %v", place.name, tc.op, v, tc.want)
			}
		}
	}
}

func equalValues(a, b any) bool {
	switch x := a.(type) {
	case []int64:
		y, ok := b.([]int64)
		if !ok || len(x) != len(y) {
			return false
		}
		for i := range x {
			if x[i] != y[i] {
				return false
			}
		}
		return true
	}
	return a == b
}

// contributeMany asks every element to contribute Rounds times in a row.
type contributeMany struct {
	Rounds int
	Target *pa.PID
}

func init() { MustRegister[contributeMany]() }

type manyElement struct{ el *Element }

func (e *manyElement) Receive(c pa.Context) {
	if m, ok := c.Message().(*contributeMany); ok {
		for k := 0; k < m.Rounds; k++ {
			if err := e.el.Contribute(float64(k*1000+e.el.Linear), Sum, m.Target); err != nil {
				panic(err)
			}
		}
	}
}

// TestReductionsInOrder: results reach the target in round order, each
// with its own round's sum, although the contributions of one rank are
// combined in several goroutines at once. (Sending each round from the
// goroutine that completed it could reorder two rounds completed at the
// same moment; this test did not catch that in 10 runs, the window being
// a few instructions wide, but it fails on any reordering it sees.)
func TestReductionsInOrder(t *testing.T) {
	rts := startLocal(t, 3)
	as := newArrays(t, rts, ArrayConfig{Name: "many", Dims: []int{48},
		New: func(el *Element) pa.Actor { return &manyElement{el: el} }})
	const rounds = 1000
	got := make(chan *Reduced, rounds)
	collector := rts[0].System().Root.Spawn(pa.PropsFromFunc(func(c pa.Context) {
		if r, ok := c.Message().(*Reduced); ok {
			got <- r
		}
	}))
	if err := as[1].Broadcast(&contributeMany{Rounds: rounds, Target: collector}); err != nil {
		t.Fatal(err)
	}
	n := as[0].Len()
	for k := 0; k < rounds; k++ {
		var r *Reduced
		select {
		case r = <-got:
		case <-time.After(20 * time.Second):
			t.Fatalf("round %d never arrived", k)
		}
		v, err := r.Result()
		if err != nil {
			t.Fatal(err)
		}
		want := float64(k*1000*n + n*(n-1)/2)
		if r.Round != uint64(k) || v != want {
			t.Fatalf("result %d: round %d sum %v, want round %d sum %v", k, r.Round, v, k, want)
		}
	}
}

// TestNilMessages: a nil message never reaches a mailbox. An array
// broadcast whose value is nil (valid msgpack, as a faulty peer could send
// it) is dropped by the manager as a decode error; the runtime's Send
// refuses nil; protoactor's own Root.Send of nil is a dead letter. Before,
// the mailbox took a posted nil for "queue empty": it never counted it as
// processed and ran its goroutine for ever.
func TestNilMessages(t *testing.T) {
	rts := startLocal(t, 2)
	got := make(chan int, 4)
	recv := func(c pa.Context) {
		if p, ok := c.Message().(*ping); ok {
			got <- p.N
		}
	}
	as := newArrays(t, rts, ArrayConfig{Name: "nil-broadcast", Dims: []int{2}, Placement: RoundRobin,
		New: func(*Element) pa.Actor { return pa.ReceiveFunc(recv) }})
	pending := func(rt *Runtime, pid *pa.PID) int64 {
		v, ok := rt.local.Load(pid.Id)
		if !ok {
			t.Fatalf("%s is not a runtime actor of rank %d", pid, rt.Rank())
		}
		return v.(*localActor).run.mbox.Load().userPending()
	}
	// A broadcast of nothing, then a real one through the same manager:
	// when the real one arrives, the manager has handled the other.
	if err := rts[0].Send(as[0].managerPID(1), &arrayBroadcast{}); err != nil {
		t.Fatal(err)
	}
	if err := rts[0].Send(as[0].managerPID(1), &arrayBroadcast{Value: anyValue{V: &ping{N: 5}}}); err != nil {
		t.Fatal(err)
	}
	select {
	case n := <-got:
		if n != 5 {
			t.Fatalf("the element got ping %d, want 5", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the element got nothing")
	}
	if n := rts[1].Stats().DecodeErrors.Load(); n != 1 {
		t.Fatalf("decode errors on rank 1: %d, want 1 (the broadcast of nothing)", n)
	}
	if n := pending(rts[1], as[0].ElementAt(1)); n != 0 {
		t.Fatalf("the element's mailbox has %d messages pending after its last", n)
	}

	pid, err := rts[0].Root().SpawnNamed(rts[0].PropsFromFunc(recv), "nil-local")
	if err != nil {
		t.Fatal(err)
	}
	if err := rts[0].Send(pid, nil); !errors.Is(err, ErrUnregistered) {
		t.Fatalf("Send of nil: %v, want ErrUnregistered", err)
	}
	dead := rts[0].Stats().DeadLetters.Load()
	rts[0].Root().Send(pid, nil)
	if n := rts[0].Stats().DeadLetters.Load(); n != dead+1 {
		t.Fatalf("dead letters %d after protoactor's Send of nil, want %d", n, dead+1)
	}
	if err := rts[0].Send(pid, &ping{N: 6}); err != nil {
		t.Fatal(err)
	}
	if n := <-got; n != 6 {
		t.Fatalf("got ping %d, want 6", n)
	}
	if n := pending(rts[0], pid); n != 0 {
		t.Fatalf("the actor's mailbox has %d messages pending after its last", n)
	}
}

// TestArrayAccessorsOutOfRange: linear numbers and ranks outside the array
// give nil or 0, as Element and RankOf do for an index outside it; they
// panicked (ElementAt, LocalCount) or wrapped around (IndexOf).
func TestArrayAccessorsOutOfRange(t *testing.T) {
	rts := startLocal(t, 2)
	as := newArrays(t, rts, ArrayConfig{Name: "accessors", Dims: []int{3},
		New: func(*Element) pa.Actor { return pa.ReceiveFunc(func(pa.Context) {}) }})
	a := as[0]
	for _, i := range []int{-1, 3} {
		if p := a.ElementAt(i); p != nil {
			t.Errorf("ElementAt(%d) = %v, want nil", i, p)
		}
		if idx := a.IndexOf(i); idx != nil {
			t.Errorf("IndexOf(%d) = %v, want nil", i, idx)
		}
	}
	for _, r := range []int{-1, 2} {
		if n := a.LocalCount(r); n != 0 {
			t.Errorf("LocalCount(%d) = %d, want 0", r, n)
		}
	}
	if p := a.ElementAt(2); p == nil || a.IndexOf(2)[0] != 2 {
		t.Errorf("element 2: %v %v", p, a.IndexOf(2))
	}
}
