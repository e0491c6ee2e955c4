package actor

import (
	"errors"
	"fmt"
	"sync"

	pa "github.com/asynkron/protoactor-go/actor"
	"go.uber.org/zap"
)

// An Op combines two contributions of a reduction. It must be associative
// (contributions are combined within a rank first, then along a tree of
// ranks, in no fixed order) and it must not modify its arguments.
type Op func(a, b any) (any, error)

// Built-in reduction operations, over int, int32, int64, uint64, float32,
// float64 and slices of those (element by element, equal lengths).
const (
	Sum = "sum"
	Min = "min"
	Max = "max"
)

var ops = struct {
	sync.RWMutex
	m map[string]Op
}{m: map[string]Op{
	Sum: numericOp(func(x, y float64) float64 { return x + y }, func(x, y int64) int64 { return x + y }, func(x, y uint64) uint64 { return x + y }),
	Min: numericOp(func(x, y float64) float64 { return min(x, y) }, func(x, y int64) int64 { return min(x, y) }, func(x, y uint64) uint64 { return min(x, y) }),
	Max: numericOp(func(x, y float64) float64 { return max(x, y) }, func(x, y int64) int64 { return max(x, y) }, func(x, y uint64) uint64 { return max(x, y) }),
}}

// RegisterOp adds a user-defined reduction under name. Every rank must
// register the same ops; the values it combines must be registered types.
func RegisterOp(name string, op Op) error {
	if name == "" || op == nil {
		return errors.New("actor: RegisterOp needs a name and a function")
	}
	ops.Lock()
	defer ops.Unlock()
	if _, ok := ops.m[name]; ok {
		return fmt.Errorf("actor: reduction op %q already registered", name)
	}
	ops.m[name] = op
	return nil
}

func lookupOp(name string) (Op, error) {
	ops.RLock()
	defer ops.RUnlock()
	op := ops.m[name]
	if op == nil {
		return nil, fmt.Errorf("actor: unknown reduction op %q", name)
	}
	return op, nil
}

// ErrReduce reports contributions an op cannot combine.
var ErrReduce = errors.New("actor: reduction")

// numericOp lifts float, signed and unsigned combiners to the numeric
// types and their slices.
func numericOp(f func(x, y float64) float64, i func(x, y int64) int64, u func(x, y uint64) uint64) Op {
	return func(a, b any) (any, error) {
		switch x := a.(type) {
		case float64:
			if y, ok := b.(float64); ok {
				return f(x, y), nil
			}
		case float32:
			if y, ok := b.(float32); ok {
				return float32(f(float64(x), float64(y))), nil
			}
		case int:
			if y, ok := b.(int); ok {
				return int(i(int64(x), int64(y))), nil
			}
		case int32:
			if y, ok := b.(int32); ok {
				return int32(i(int64(x), int64(y))), nil
			}
		case int64:
			if y, ok := b.(int64); ok {
				return i(x, y), nil
			}
		case uint64:
			if y, ok := b.(uint64); ok {
				return u(x, y), nil
			}
		case []float64:
			if y, ok := b.([]float64); ok {
				return zipSlices(x, y, f)
			}
		case []int64:
			if y, ok := b.([]int64); ok {
				return zipSlices(x, y, i)
			}
		case []int:
			if y, ok := b.([]int); ok {
				return zipSlices(x, y, func(p, q int) int { return int(i(int64(p), int64(q))) })
			}
		}
		return nil, fmt.Errorf("%w: cannot combine %T and %T", ErrReduce, a, b)
	}
}

func zipSlices[T any](x, y []T, f func(T, T) T) (any, error) {
	if len(x) != len(y) {
		return nil, fmt.Errorf("%w: slices of lengths %d and %d", ErrReduce, len(x), len(y))
	}
	out := make([]T, len(x))
	for k := range x {
		out[k] = f(x[k], y[k])
	}
	return out, nil
}

// Reduced is the result of a reduction, delivered to the target the
// contributions named (an actor, or a future's PID).
type Reduced struct {
	Array string   // the array's name
	Round uint64   // the reduction's number: an element's k-th contribution belongs to round k
	Op    string   // the op
	Value anyValue // the combined value (use Result)
	Err   string   // why the reduction failed ("" on success)
}

// Result returns the reduced value, or the error that stopped the reduction.
func (r *Reduced) Result() (any, error) {
	if r.Err != "" {
		return nil, fmt.Errorf("%w of array %s round %d: %s", ErrReduce, r.Array, r.Round, r.Err)
	}
	return r.Value.V, nil
}

// Contribute adds this element's value to its next reduction with op
// (Sum, Min, Max or a registered name). Every element of the array
// contributes once per reduction, with the same op and target; the result
// goes to target as a *Reduced message. Call it from the element's actor.
func (el *Element) Contribute(value any, op string, target *pa.PID) error {
	if _, err := lookupOp(op); err != nil {
		return err
	}
	if target == nil {
		return fmt.Errorf("%w: no target", ErrReduce)
	}
	if err := Check(value); err != nil {
		return err
	}
	round := el.round
	el.round++
	// Combined here, in the element's goroutine: a hop through the
	// manager's mailbox would cost a goroutine switch per contribution.
	el.Array.add(round, op, target, false, value, "")
	return nil
}

// reducePartial is a rank's combined contributions on its way up the tree.
type reducePartial struct {
	Round    uint64
	Op       string
	Target   *pa.PID
	Empty    bool // the subtree has no elements
	Err      string
	Value    anyValue
	FromRank int
}

// pending is one reduction round in progress on a rank.
type pending struct {
	have   int
	empty  bool
	value  any
	op     string
	target *pa.PID
	err    string
}

// reduction is an array's rounds in progress on one rank. The rank's
// elements add their contributions from their own goroutines; the manager
// adds the partials of the rank's children in the tree of ranks (parent of
// r is (r-1)/2).
type reduction struct {
	mu     sync.Mutex
	rounds map[uint64]*pending
	want   int // local elements + children in the tree
	// Complete rounds leave in the order they completed (which is round
	// order: every element contributes to round k before k+1), sent by
	// one goroutine at a time, without the lock held.
	done    []doneRound
	next    int  // done[next:] are still to send
	sending bool // a goroutine is sending them
}

// doneRound is a complete round waiting to be sent.
type doneRound struct {
	round uint64
	p     *pending
}

func newReduction(a *Array) *reduction {
	return &reduction{rounds: map[uint64]*pending{}, want: a.perRank[a.rt.rank] + len(a.children())}
}

// manager is an array's actor on each rank: it fans broadcasts out to the
// rank's elements and adds the partials child ranks send up the tree.
type manager struct {
	a *Array
}

// children are this rank's children in the tree whose subtrees hold
// elements: a subtree without any never contributes, so its parent must
// not wait for it (a rank hosting no elements, as Block placement leaves
// when an array has fewer elements than there are ranks, once stalled
// every round).
func (a *Array) children() []int {
	var cs []int
	for _, c := range []int{2*a.rt.rank + 1, 2*a.rt.rank + 2} {
		if a.subtreeCount(c) > 0 {
			cs = append(cs, c)
		}
	}
	return cs
}

// subtreeCount is the number of elements on rank r and its descendants.
func (a *Array) subtreeCount(r int) int {
	if r >= a.rt.size {
		return 0
	}
	return a.perRank[r] + a.subtreeCount(2*r+1) + a.subtreeCount(2*r+2)
}

// Receive implements protoactor's Actor.
func (m *manager) Receive(c pa.Context) {
	switch msg := c.Message().(type) {
	case *arrayBroadcast:
		if msg.Value.V == nil {
			// Broadcast never sends one; a malformed message from the wire.
			m.a.rt.stats.DecodeErrors.Add(1)
			m.a.rt.log.Warn("array broadcast without a value dropped", zap.String("array", m.a.name))
			return
		}
		for _, i := range m.a.local {
			c.Send(m.a.ElementAt(i), msg.Value.V)
		}
	case *reducePartial:
		m.a.add(msg.Round, msg.Op, msg.Target, msg.Empty, msg.Value.V, msg.Err)
	}
}

// add combines a contribution (or a child's partial) into its round, and
// sends the rounds that are complete, unless another goroutine is sending
// them already.
func (a *Array) add(round uint64, op string, target *pa.PID, empty bool, v any, errText string) {
	r := a.red
	r.mu.Lock()
	r.addLocked(round, op, target, empty, v, errText)
	if r.sending {
		r.mu.Unlock()
		return
	}
	r.sending = true
	for r.next < len(r.done) {
		d := r.done[r.next]
		r.done[r.next] = doneRound{}
		r.next++
		r.mu.Unlock()
		a.finish(d.round, d.p)
		r.mu.Lock()
	}
	r.done, r.next, r.sending = r.done[:0], 0, false
	r.mu.Unlock()
}

// addLocked combines a contribution into its round and queues the round
// once it holds everything this rank waits for.
func (r *reduction) addLocked(round uint64, op string, target *pa.PID, empty bool, v any, errText string) {
	p := r.rounds[round]
	if p == nil {
		p = &pending{empty: true, op: op, target: target}
		r.rounds[round] = p
	}
	p.have++
	switch {
	case errText != "":
		if p.err == "" {
			p.err = errText
		}
	case p.op != op:
		p.err = fmt.Sprintf("contributions with ops %q and %q", p.op, op)
	case empty:
	case p.empty:
		p.value, p.empty = v, false
	case p.err == "":
		f, err := lookupOp(op)
		if err == nil {
			v, err = combine(f, op, p.value, v)
		}
		if err != nil {
			p.err = err.Error()
		} else {
			p.value = v
		}
	}
	if p.have < r.want {
		return
	}
	delete(r.rounds, round)
	r.done = append(r.done, doneRound{round, p})
}

// combine applies a user's op to two contributions. A panic in it fails
// the round with the panic's value rather than the goroutine that added
// the contribution (an element, or the manager with its rounds).
func combine(f Op, name string, a, b any) (v any, err error) {
	defer func() {
		if r := recover(); r != nil {
			v, err = nil, fmt.Errorf("%w: op %q panicked: %v", ErrReduce, name, r)
		}
	}()
	return f(a, b)
}

// finish sends a complete round up the tree, or delivers it at the root.
func (a *Array) finish(round uint64, p *pending) {
	rt := a.rt
	if rt.rank != 0 {
		part := &reducePartial{Round: round, Op: p.op, Target: p.target, Empty: p.empty, Err: p.err,
			Value: anyValue{V: p.value}, FromRank: rt.rank}
		parent := a.managerPID((rt.rank - 1) / 2)
		if err := rt.Send(parent, part); err != nil {
			// The value cannot travel (its type is not registered, say):
			// the round still completes at the root, failed.
			rt.log.Error("reduction partial not sent", zap.String("array", a.name), zap.Error(err))
			part.Value, part.Empty = anyValue{}, true
			part.Err = fmt.Sprintf("rank %d could not send its partial: %v", rt.rank, err)
			if err := rt.Send(parent, part); err != nil {
				rt.log.Error("reduction failure not sent", zap.String("array", a.name), zap.Error(err))
			}
		}
		return
	}
	res := &Reduced{Array: a.name, Round: round, Op: p.op, Value: anyValue{V: p.value}, Err: p.err}
	if p.empty && p.err == "" {
		res.Err = "no contributions"
	}
	if err := rt.Send(p.target, res); err != nil {
		rt.log.Error("reduction result not delivered", zap.String("array", a.name), zap.Error(err))
		res.Value, res.Err = anyValue{}, fmt.Sprintf("the result could not be sent: %v", err)
		if err := rt.Send(p.target, res); err != nil {
			rt.log.Error("reduction failure not delivered", zap.String("array", a.name), zap.Error(err))
		}
	}
}
