// Package facesim is the Faces nearest-neighbour exchange (after the Faces
// microbenchmark of the stream-triggered MPI paper): each rank owns an L^3
// block of a periodic 3-D grid of uint64 cells in device memory, on a 3-D grid
// of ranks. An iteration updates every cell ("compute"), packs the six faces
// on a stream, exchanges them with the six neighbours (which may be the same
// rank, or the rank itself, on small grids) and adds each received face to
// the cells it touches. The exchange runs either through a stream-triggered
// queue (Start/Wait on the stream, nothing blocks the host until the final
// synchronisation) or through plain host-driven tagged sends of staged
// faces. The result is compared, cell by cell, with a serial computation of
// the whole grid.
package facesim

import (
	"context"
	"encoding/binary"
	"fmt"
	"time"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
)

// Modes of the exchange.
const (
	ModeQueue = "queue" // stream-triggered queue
	ModePlain = "plain" // host-driven Isend/Irecv after a stream synchronisation
)

// Config sizes a run.
type Config struct {
	L     int // cells per block edge (>= 2)
	Iters int // iterations
	// TagBase offsets the tags (0..5 + TagBase), so that two runs in one job
	// do not collide.
	TagBase int
}

// Grid is a 3-D factorisation of the job: Dims[0]*Dims[1]*Dims[2] ranks.
type Grid struct{ Dims [3]int }

// NewGrid factorises n into three dimensions, as even as possible.
func NewGrid(n int) Grid {
	best := [3]int{n, 1, 1}
	for a := 1; a <= n; a++ {
		if n%a != 0 {
			continue
		}
		for b := 1; b <= n/a; b++ {
			if (n/a)%b != 0 {
				continue
			}
			c := n / a / b
			if spread(a, b, c) < spread(best[0], best[1], best[2]) {
				best = [3]int{a, b, c}
			}
		}
	}
	return Grid{best}
}

func spread(a, b, c int) int { return max(a, b, c) - min(a, b, c) }

// Coords returns a rank's position.
func (g Grid) Coords(r int) [3]int {
	return [3]int{r % g.Dims[0], (r / g.Dims[0]) % g.Dims[1], r / (g.Dims[0] * g.Dims[1])}
}

// Rank returns the rank at (periodic) coordinates.
func (g Grid) Rank(c [3]int) int {
	for a := 0; a < 3; a++ {
		c[a] = (c[a]%g.Dims[a] + g.Dims[a]) % g.Dims[a]
	}
	return c[0] + g.Dims[0]*(c[1]+g.Dims[1]*c[2])
}

// Directions: 2*axis + (0 for minus, 1 for plus).
func opposite(d int) int { return d ^ 1 }

// Neighbour returns the rank across face d of rank r.
func (g Grid) Neighbour(r, d int) int {
	c := g.Coords(r)
	if d&1 == 0 {
		c[d/2]--
	} else {
		c[d/2]++
	}
	return g.Rank(c)
}

// initial is a cell's starting value from its global coordinates.
func initial(x, y, z int) uint64 {
	v := uint64(x)*0x9e3779b97f4a7c15 ^ uint64(y)*0xbf58476d1ce4e5b9 ^ uint64(z)*0x94d049bb133111eb
	return v ^ v>>29
}

// compute is the per-iteration update of every cell.
func compute(v uint64, iter int) uint64 { return v*3 + uint64(iter) + 1 }

// faceCells calls f(a, b, cell) for every cell of face d of an L^3 block in
// C order (x slowest), a and b being the face's two free coordinates.
func faceCells(L, d int, f func(a, b, cell int)) {
	fixed := 0
	if d&1 == 1 {
		fixed = L - 1
	}
	for a := 0; a < L; a++ {
		for b := 0; b < L; b++ {
			var x, y, z int
			switch d / 2 {
			case 0:
				x, y, z = fixed, a, b
			case 1:
				x, y, z = a, fixed, b
			default:
				x, y, z = a, b, fixed
			}
			f(a, b, (x*L+y)*L+z)
		}
	}
}

// Reference computes the block of rank r after iters iterations serially,
// from the whole grid.
func Reference(g Grid, L, iters, r int) []uint64 {
	G := [3]int{g.Dims[0] * L, g.Dims[1] * L, g.Dims[2] * L}
	idx := func(x, y, z int) int { return (x*G[1]+y)*G[2] + z }
	u := make([]uint64, G[0]*G[1]*G[2])
	for x := 0; x < G[0]; x++ {
		for y := 0; y < G[1]; y++ {
			for z := 0; z < G[2]; z++ {
				u[idx(x, y, z)] = initial(x, y, z)
			}
		}
	}
	next := make([]uint64, len(u))
	for it := 0; it < iters; it++ {
		for i := range u {
			u[i] = compute(u[i], it)
		}
		copy(next, u)
		for x := 0; x < G[0]; x++ {
			for y := 0; y < G[1]; y++ {
				for z := 0; z < G[2]; z++ {
					c := [3]int{x, y, z}
					for d := 0; d < 6; d++ {
						axis := d / 2
						local := c[axis] % L
						if (d&1 == 0 && local != 0) || (d&1 == 1 && local != L-1) {
							continue
						}
						n := c
						if d&1 == 0 {
							n[axis] = (n[axis] - 1 + G[axis]) % G[axis]
						} else {
							n[axis] = (n[axis] + 1) % G[axis]
						}
						next[idx(x, y, z)] += u[idx(n[0], n[1], n[2])]
					}
				}
			}
		}
		u, next = next, u
	}
	o := g.Coords(r)
	out := make([]uint64, L*L*L)
	for x := 0; x < L; x++ {
		for y := 0; y < L; y++ {
			for z := 0; z < L; z++ {
				out[(x*L+y)*L+z] = u[idx(o[0]*L+x, o[1]*L+y, o[2]*L+z)]
			}
		}
	}
	return out
}

// Rank is one rank's state.
type Rank struct {
	t      *transport.Transport
	sys    *gpu.System
	stream *gpu.Stream
	grid   Grid
	cfg    Config
	nb     [6]int

	u      []uint64   // the field on the host (compute and unpack run here)
	dU     gpu.Buffer // the field on the device
	up     gpu.Buffer // pinned upload buffer
	send   [6]gpu.Buffer
	recv   [6]gpu.Buffer
	hSend  [6]gpu.Buffer // pinned staging (plain mode)
	hRecv  [6]gpu.Buffer // pinned: received faces, downloaded
	allocs []gpu.Buffer
}

// NewRank allocates a rank's buffers and sets the initial field.
func NewRank(t *transport.Transport, sys *gpu.System, cfg Config) (*Rank, error) {
	if cfg.L < 2 || cfg.L > 1<<10 {
		return nil, fmt.Errorf("facesim: L = %d, want 2 to %d cells per block edge", cfg.L, 1<<10)
	}
	if cfg.Iters < 1 {
		return nil, fmt.Errorf("facesim: %d iterations, want at least 1", cfg.Iters)
	}
	dev := sys.Devices()[0]
	s, err := dev.NewStream()
	if err != nil {
		return nil, err
	}
	r := &Rank{t: t, sys: sys, stream: s, grid: NewGrid(t.Size()), cfg: cfg}
	L := cfg.L
	face := L * L * 8
	alloc := func(n int, device bool) (gpu.Buffer, error) {
		var b gpu.Buffer
		var err error
		if device {
			b, err = dev.Alloc(n)
		} else {
			b, err = sys.AllocHost(n)
		}
		if err == nil {
			r.allocs = append(r.allocs, b)
		}
		return b, err
	}
	if r.dU, err = alloc(L*L*L*8, true); err != nil {
		return nil, err
	}
	if r.up, err = alloc(L*L*L*8, false); err != nil {
		return nil, err
	}
	for d := 0; d < 6; d++ {
		r.nb[d] = r.grid.Neighbour(t.Rank(), d)
		for _, p := range []*gpu.Buffer{&r.send[d], &r.recv[d]} {
			if *p, err = alloc(face, true); err != nil {
				return nil, err
			}
		}
		for _, p := range []*gpu.Buffer{&r.hSend[d], &r.hRecv[d]} {
			if *p, err = alloc(face, false); err != nil {
				return nil, err
			}
		}
	}
	r.Reset()
	return r, nil
}

// Reset sets the initial field.
func (r *Rank) Reset() {
	L := r.cfg.L
	o := r.grid.Coords(r.t.Rank())
	r.u = make([]uint64, L*L*L)
	for x := 0; x < L; x++ {
		for y := 0; y < L; y++ {
			for z := 0; z < L; z++ {
				r.u[(x*L+y)*L+z] = initial(o[0]*L+x, o[1]*L+y, o[2]*L+z)
			}
		}
	}
}

// Field returns the rank's block.
func (r *Rank) Field() []uint64 { return r.u }

// Close releases the rank's memory and stream.
func (r *Rank) Close() error {
	_ = r.stream.Synchronize()
	for _, b := range r.allocs {
		_ = gpu.Free(b)
	}
	return r.stream.Destroy()
}

// pack enqueues the face copies from the device field into the device send
// buffers (the "pack kernels").
func (r *Rank) pack() error {
	L := r.cfg.L
	for d := 0; d < 6; d++ {
		var err error
		faceCells(L, d, func(a, b, cell int) {
			if err != nil {
				return
			}
			src, e1 := r.dU.Slice(cell*8, 8)
			dst, e2 := r.send[d].Slice((a*L+b)*8, 8)
			if e1 != nil || e2 != nil {
				err = fmt.Errorf("facesim: face slices: %v %v", e1, e2)
				return
			}
			err = gpu.CopyAsync(r.stream, dst, src)
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// Iterate runs cfg.Iters iterations in mode and returns the time spent. It
// fails with the first failed operation (a lost peer, say) and ends when
// ctx does, even while the stream waits for a neighbour that never sends.
func (r *Rank) Iterate(ctx context.Context, mode string) (time.Duration, error) {
	var q *transport.Queue
	if mode == ModeQueue {
		var err error
		if q, err = r.t.NewQueue(r.stream); err != nil {
			return 0, err
		}
		defer q.Free()
		// The stream's wait on the queue does not watch ctx: freeing the
		// queue releases it (and fails what is in flight).
		stop := context.AfterFunc(ctx, func() { _ = q.Free() })
		defer stop()
	} else if mode != ModePlain {
		return 0, fmt.Errorf("facesim: unknown mode %q", mode)
	}
	L, tb := r.cfg.L, r.cfg.TagBase
	up, err := r.up.Bytes()
	if err != nil {
		return 0, err
	}
	start := time.Now()
	for it := 0; it < r.cfg.Iters; it++ {
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		for i := range r.u {
			r.u[i] = compute(r.u[i], it)
			binary.LittleEndian.PutUint64(up[i*8:], r.u[i])
		}
		if err := gpu.CopyAsync(r.stream, r.dU, r.up); err != nil {
			return 0, err
		}
		if err := r.pack(); err != nil {
			return 0, err
		}
		switch mode {
		case ModeQueue:
			for d := 0; d < 6; d++ {
				if _, err := q.EnqueueRecv(r.recv[d], r.nb[d], tb+opposite(d)); err != nil {
					return 0, err
				}
			}
			for d := 0; d < 6; d++ {
				if _, err := q.EnqueueSend(r.send[d], r.nb[d], tb+d); err != nil {
					return 0, err
				}
			}
			if err := q.Start(); err != nil {
				return 0, err
			}
			if err := q.Wait(); err != nil {
				return 0, err
			}
			for d := 0; d < 6; d++ {
				if err := gpu.CopyAsync(r.stream, r.hRecv[d], r.recv[d]); err != nil {
					return 0, err
				}
			}
			if err := r.stream.Synchronize(); err != nil {
				return 0, err
			}
			// The stream passed the Wait even if an exchange failed: the
			// queue's sticky error says whether the faces arrived.
			if err := ctx.Err(); err != nil {
				return 0, err
			}
			if err := q.Err(); err != nil {
				return 0, err
			}
		case ModePlain:
			for d := 0; d < 6; d++ {
				if err := gpu.CopyAsync(r.stream, r.hSend[d], r.send[d]); err != nil {
					return 0, err
				}
			}
			if err := r.stream.Synchronize(); err != nil {
				return 0, err
			}
			var reqs []*transport.Request
			for d := 0; d < 6; d++ {
				b, _ := r.hRecv[d].Bytes()
				q, err := r.t.Irecv(r.nb[d], tb+opposite(d), b)
				if err != nil {
					return 0, err
				}
				reqs = append(reqs, q)
			}
			for d := 0; d < 6; d++ {
				b, _ := r.hSend[d].Bytes()
				q, err := r.t.Isend(r.nb[d], tb+d, b)
				if err != nil {
					return 0, err
				}
				reqs = append(reqs, q)
			}
			for _, q := range reqs {
				if _, err := q.Wait(ctx); err != nil {
					return 0, err
				}
			}
		}
		// Unpack: add each received face to the cells it touches.
		for d := 0; d < 6; d++ {
			hb, _ := r.hRecv[d].Bytes()
			faceCells(L, d, func(a, b, cell int) {
				r.u[cell] += binary.LittleEndian.Uint64(hb[(a*L+b)*8:])
			})
		}
	}
	return time.Since(start), nil
}

// Check compares the rank's block with the serial reference after iters
// iterations and describes the first difference.
func (r *Rank) Check() error {
	ref := Reference(r.grid, r.cfg.L, r.cfg.Iters, r.t.Rank())
	for i := range ref {
		if ref[i] != r.u[i] {
			return fmt.Errorf("facesim: rank %d cell %d: %#x, reference %#x", r.t.Rank(), i, r.u[i], ref[i])
		}
	}
	return nil
}
