package integration

import (
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/actor"
)

// Messages of the array scenario.
type (
	// where asks an element which rank hosts it; here is the answer.
	where struct{}
	here  struct{ Rank, Linear int }
	// reduceCmd asks every element to contribute to one reduction.
	reduceCmd struct {
		Op     string
		Target *pa.PID
		Slice  bool
	}
)

// opAbsMax is a user-defined reduction: the value of largest magnitude.
const opAbsMax = "itest-absmax"

func init() {
	actor.MustRegister[where]()
	actor.MustRegister[here]()
	actor.MustRegister[reduceCmd]()
	if err := actor.RegisterOp(opAbsMax, func(a, b any) (any, error) {
		x, y := a.(float64), b.(float64)
		if math.Abs(y) > math.Abs(x) {
			return y, nil
		}
		return x, nil
	}); err != nil {
		panic(err)
	}
	scenarios["actor-array"] = actorArray
}

// arrayElement answers where and contributes its (signed) linear number.
type arrayElement struct {
	el *actor.Element
	rt *actor.Runtime
}

func (e *arrayElement) Receive(c pa.Context) {
	switch m := c.Message().(type) {
	case *where:
		c.Respond(&here{Rank: e.rt.Rank(), Linear: e.el.Linear})
	case *reduceCmd:
		v := any(elementValue(e.el.Linear))
		if m.Slice {
			v = []int64{int64(e.el.Linear), 1}
		}
		if err := e.el.Contribute(v, m.Op, m.Target); err != nil {
			fmt.Printf("contribute: %v\n", err)
		}
	}
}

// elementValue is element i's contribution: -i for odd i, so that absmax
// differs from max.
func elementValue(i int) float64 {
	if i%2 == 1 {
		return -float64(i)
	}
	return float64(i)
}

// reversed is a custom placement: round robin from the last rank down.
func reversed(_ actor.Index, linear int, _ []int, ranks int) int {
	return ranks - 1 - linear%ranks
}

// actorArray: on 3 ranks, arrays with three placements; rank 0 asks every
// element where it lives (placement as computed on every rank), then
// broadcasts reduction commands whose results go to futures on rank 0: sum,
// min, max, an element-wise slice sum and a user op.
func actorArray(ctx context.Context, r *rank) error {
	return withActors(ctx, r, actor.Options{}, func(rt *actor.Runtime) error {
		for _, pl := range []struct {
			name string
			p    actor.Placement
		}{{"block", actor.Block}, {"roundrobin", actor.RoundRobin}, {"reversed", reversed}} {
			a, err := rt.NewArray(ctx, actor.ArrayConfig{Name: "arr-" + pl.name, Dims: []int{5, 4}, Placement: pl.p,
				New: func(el *actor.Element) pa.Actor { return &arrayElement{el: el, rt: rt} }})
			if err != nil {
				return err
			}
			if rt.Rank() == 0 {
				if err := checkArray(rt, a, pl.name, pl.p); err != nil {
					return err
				}
			}
			if err := r.b.Barrier(ctx, "array."+pl.name); err != nil {
				return err
			}
		}
		r.logf("array placement, broadcast and reductions ok")
		return nil
	})
}

func checkArray(rt *actor.Runtime, a *actor.Array, name string, place actor.Placement) error {
	n := a.Len()
	for i := 0; i < n; i++ {
		idx := a.IndexOf(i)
		want := place(idx, i, a.Dims(), rt.Size())
		if a.RankOf(idx...) != want {
			return fmt.Errorf("%s: RankOf(%v) = %d, placement says %d", name, idx, a.RankOf(idx...), want)
		}
		res, err := rt.Request(a.Element(idx...), &where{}, actorTimeout)
		if err != nil {
			return fmt.Errorf("%s: element %v: %w", name, idx, err)
		}
		if h := res.(*here); h.Rank != want || h.Linear != i {
			return fmt.Errorf("%s: element %v answered from rank %d as %d, want rank %d", name, idx, h.Rank, h.Linear, want)
		}
	}
	sum, absmax := 0.0, 0.0
	for i := 0; i < n; i++ {
		v := elementValue(i)
		sum += v
		if math.Abs(v) > math.Abs(absmax) {
			absmax = v
		}
	}
	for _, tc := range []struct {
		op    string
		slice bool
		want  any
	}{
		{actor.Sum, false, sum},
		{actor.Min, false, nil}, // computed below
		{actor.Max, false, nil},
		{opAbsMax, false, absmax},
		{actor.Sum, true, []int64{int64(n * (n - 1) / 2), int64(n)}},
	} {
		want := tc.want
		switch tc.op {
		case actor.Min, actor.Max:
			lo, hi := math.Inf(1), math.Inf(-1)
			for i := 0; i < n; i++ {
				lo, hi = math.Min(lo, elementValue(i)), math.Max(hi, elementValue(i))
			}
			if tc.op == actor.Min {
				want = lo
			} else {
				want = hi
			}
		}
		f := pa.NewFuture(rt.System(), actorTimeout)
		if err := a.Broadcast(&reduceCmd{Op: tc.op, Target: f.PID(), Slice: tc.slice}); err != nil {
			return err
		}
		res, err := f.Result()
		if err != nil {
			return fmt.Errorf("%s %s: %w", name, tc.op, err)
		}
		got, err := res.(*actor.Reduced).Result()
		if err != nil {
			return fmt.Errorf("%s %s: %w", name, tc.op, err)
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			return fmt.Errorf("%s %s: got %v, want %v", name, tc.op, got, want)
		}
	}
	return nil
}

func TestActorArray(t *testing.T) {
	forActorTLS(t, func(t *testing.T, c cfg) {
		res := runJobFor(t, "actor-array", actorRanks, c, 2*time.Minute)
		for i := 0; i < actorRanks; i++ {
			requireLine(t, res, fmt.Sprintf("[%d] rank %d: array placement, broadcast and reductions ok", i, i))
		}
	})
}
