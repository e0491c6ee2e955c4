package actor

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	pa "github.com/asynkron/protoactor-go/actor"
)

// Index is a point of an actor array's index space, one coordinate per
// dimension.
type Index []int

// Placement maps an element (its index and its row-major linear number) of
// an array with dims to one of ranks ranks.
type Placement func(idx Index, linear int, dims []int, ranks int) int

// Block places contiguous runs of the row-major order on each rank: rank r
// gets elements [r*N/P, (r+1)*N/P).
func Block(_ Index, linear int, dims []int, ranks int) int {
	return blockRank(linear, volume(dims), ranks)
}

func blockRank(i, n, p int) int {
	// The largest r with r*n/p <= i.
	r := int((int64(i)*int64(p) + int64(p) - 1) / int64(n))
	for r > 0 && int64(r)*int64(n)/int64(p) > int64(i) {
		r--
	}
	for r+1 < p && int64(r+1)*int64(n)/int64(p) <= int64(i) {
		r++
	}
	return r
}

// RoundRobin places element i on rank i mod P.
func RoundRobin(_ Index, linear int, _ []int, ranks int) int { return linear % ranks }

// ArrayConfig describes an actor array (a Charm++ chare array): an
// N-dimensional index space of elements of one kind spread over the ranks.
type ArrayConfig struct {
	// Name identifies the array in the job; every rank uses the same name.
	Name string
	// Dims is the extent of each dimension (at least one, all positive).
	Dims []int
	// Placement chooses each element's rank (default Block).
	Placement Placement
	// New makes the actor of one element; it runs on the element's rank.
	New func(el *Element) pa.Actor
	// Props adds protoactor props options to the elements.
	PropsOptions []pa.PropsOption
}

// Array is one rank's handle on an actor array.
type Array struct {
	rt      *Runtime
	name    string
	dims    []int
	n       int
	place   []int32    // rank of each element, by linear number
	local   []int      // linear numbers of this rank's elements
	perRank []int      // element count per rank
	red     *reduction // this rank's reductions in progress (reduce.go)
}

// Element is what an array element's actor knows about itself.
type Element struct {
	Array  *Array
	Index  Index
	Linear int
	round  uint64
}

// ErrArray reports an invalid array configuration or index.
var ErrArray = errors.New("actor: array")

func volume(dims []int) int {
	n := 1
	for _, d := range dims {
		n *= d
	}
	return n
}

// NewArray creates an actor array. It is collective: every rank calls it
// with the same configuration, and it returns once every element of every
// rank exists, so elements may be messaged at once.
func (rt *Runtime) NewArray(ctx context.Context, cfg ArrayConfig) (*Array, error) {
	if cfg.Name == "" || strings.ContainsAny(cfg.Name, "/") {
		return nil, fmt.Errorf("%w: name %q must be non-empty without '/'", ErrArray, cfg.Name)
	}
	if len(cfg.Dims) == 0 {
		return nil, fmt.Errorf("%w %s: no dimensions", ErrArray, cfg.Name)
	}
	n := 1
	for i, d := range cfg.Dims {
		if d <= 0 {
			return nil, fmt.Errorf("%w %s: dimension %d has extent %d", ErrArray, cfg.Name, i, d)
		}
		if n > (1<<31)/d {
			return nil, fmt.Errorf("%w %s: more than 2^31 elements", ErrArray, cfg.Name)
		}
		n *= d
	}
	if cfg.New == nil {
		return nil, fmt.Errorf("%w %s: no New function", ErrArray, cfg.Name)
	}
	place := cfg.Placement
	if place == nil {
		place = Block
	}
	a := &Array{rt: rt, name: cfg.Name, dims: append([]int(nil), cfg.Dims...), n: n,
		place: make([]int32, n), perRank: make([]int, rt.size)}
	idx := make(Index, len(a.dims))
	for i := 0; i < n; i++ {
		a.unlinear(i, idx)
		r := place(idx, i, a.dims, rt.size)
		if r < 0 || r >= rt.size {
			return nil, fmt.Errorf("%w %s: placement put element %v on rank %d of %d", ErrArray, cfg.Name, idx, r, rt.size)
		}
		a.place[i] = int32(r)
		a.perRank[r]++
		if r == rt.rank {
			a.local = append(a.local, i)
		}
	}
	a.red = newReduction(a)
	_, err := rt.sys.Root.SpawnNamed(rt.Props(func() pa.Actor { return &manager{a: a} }), a.managerID())
	if err != nil {
		return nil, fmt.Errorf("%w %s: %v", ErrArray, cfg.Name, err)
	}
	for _, i := range a.local {
		el := &Element{Array: a, Index: a.IndexOf(i), Linear: i}
		props := rt.Props(func() pa.Actor { return cfg.New(el) }, cfg.PropsOptions...)
		if _, err := rt.sys.Root.SpawnNamed(props, a.elementID(i)); err != nil {
			return nil, fmt.Errorf("%w %s: spawning element %v: %v", ErrArray, cfg.Name, el.Index, err)
		}
	}
	if err := rt.t.Bootstrap().Barrier(ctx, "troupe.array."+cfg.Name); err != nil {
		return nil, fmt.Errorf("%w %s: waiting for the other ranks: %v", ErrArray, cfg.Name, err)
	}
	return a, nil
}

func (a *Array) managerID() string        { return a.name + "/mgr" }
func (a *Array) elementID(i int) string   { return a.name + "/" + strconv.Itoa(i) }
func (a *Array) managerPID(r int) *pa.PID { return a.rt.PID(r, a.managerID()) }

// Name is the array's name.
func (a *Array) Name() string { return a.name }

// Dims returns the extent of each dimension.
func (a *Array) Dims() []int { return append([]int(nil), a.dims...) }

// Len is the number of elements.
func (a *Array) Len() int { return a.n }

// Local returns the linear numbers of this rank's elements.
func (a *Array) Local() []int { return append([]int(nil), a.local...) }

// LocalCount returns how many elements rank r hosts (0 for a rank outside
// the job).
func (a *Array) LocalCount(r int) int {
	if r < 0 || r >= len(a.perRank) {
		return 0
	}
	return a.perRank[r]
}

// Linear returns the row-major linear number of idx, or -1 when idx is
// outside the index space.
func (a *Array) Linear(idx ...int) int {
	if len(idx) != len(a.dims) {
		return -1
	}
	l := 0
	for d, x := range idx {
		if x < 0 || x >= a.dims[d] {
			return -1
		}
		l = l*a.dims[d] + x
	}
	return l
}

// IndexOf returns the index of linear element i, or nil when i is not an
// element's linear number.
func (a *Array) IndexOf(i int) Index {
	if i < 0 || i >= a.n {
		return nil
	}
	idx := make(Index, len(a.dims))
	a.unlinear(i, idx)
	return idx
}

func (a *Array) unlinear(i int, idx Index) {
	for d := len(a.dims) - 1; d >= 0; d-- {
		idx[d] = i % a.dims[d]
		i /= a.dims[d]
	}
}

// RankOf returns the rank hosting the element at idx, or -1 outside the
// index space.
func (a *Array) RankOf(idx ...int) int {
	l := a.Linear(idx...)
	if l < 0 {
		return -1
	}
	return int(a.place[l])
}

// Element returns the PID of the element at idx (from any rank, without a
// lookup), or nil when idx is outside the index space.
func (a *Array) Element(idx ...int) *pa.PID {
	l := a.Linear(idx...)
	if l < 0 {
		return nil
	}
	return a.ElementAt(l)
}

// ElementAt returns the PID of linear element i, or nil when i is not an
// element's linear number.
func (a *Array) ElementAt(i int) *pa.PID {
	if i < 0 || i >= a.n {
		return nil
	}
	return a.rt.PID(int(a.place[i]), a.elementID(i))
}

// Broadcast delivers msg to every element: one message to each rank, whose
// array manager hands it to its local elements (they share the decoded
// value, so treat it as read-only). A message that cannot travel nested in
// the broadcast (one with a Payload field, say) fails before any element
// gets it.
func (a *Array) Broadcast(msg any) error {
	if err := Check(msg); err != nil {
		return err
	}
	b := &arrayBroadcast{Value: anyValue{V: msg}}
	if a.subtreeCount(0) > a.perRank[a.rt.rank] { // some element is remote
		ct, _, err := lookupType(b)
		if err == nil {
			_, _, err = encodeBody(ct, b)
		}
		if err != nil {
			return fmt.Errorf("actor: broadcast: %w", err)
		}
	}
	var errs []error
	for r := 0; r < a.rt.size; r++ {
		if a.perRank[r] == 0 {
			continue
		}
		if err := a.rt.Send(a.managerPID(r), b); err != nil {
			errs = append(errs, fmt.Errorf("broadcast to rank %d: %w", r, err))
		}
	}
	return errors.Join(errs...)
}

// arrayBroadcast is a broadcast on its way to a rank's elements.
type arrayBroadcast struct {
	Value anyValue
}

func init() {
	MustRegister[arrayBroadcast]()
	MustRegister[reducePartial]()
	MustRegister[Reduced]()
}
