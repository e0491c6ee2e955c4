package jacobi

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/actor"
	"github.com/troupe-hpc/troupe/gpu"
)

// Config describes a Jacobi3D run. Every rank passes the same Config to Run.
type Config struct {
	// Name names the actor array (and the driver, Name+"-driver"); runs
	// sharing runtimes need distinct names. Default "jacobi3d".
	Name string
	// NX, NY, NZ are the numbers of interior points per dimension.
	NX, NY, NZ int
	// Blocks is the actor array's shape: the grid is cut into
	// Blocks[0] x Blocks[1] x Blocks[2] blocks (zero: JobBlocks).
	Blocks [3]int
	// Warmup sweeps come before the timed ones; the run does
	// S = Warmup + Iters sweeps (at most that many with Tol).
	Warmup, Iters int
	// Tol > 0 stops the run once a reduced residual is <= Tol: the blocks,
	// allowed one reduction interval ahead of the driver, stop at the end of
	// the interval they are in (or after S sweeps, whichever comes first).
	Tol float64
	// ReduceEvery is K: the residual is reduced after every K-th sweep and
	// after the last one (default 1).
	ReduceEvery int
	// Check makes rank 0 gather the final field and compare it with the
	// serial reference.
	Check bool
	// GPU keeps every block's field in device memory and runs the stencil,
	// the face packing and the ghost unpacking as kernels on the block's
	// stream: Go kernels (gpu.LaunchHost) on the host backend, the device
	// code of kernels.cu (embedded PTX) on the cuda backend. Halo faces
	// travel as device buffers, through GPUAPI.
	GPU bool
	// GPUAPI is how device halos travel: APIMessaging (default) or
	// APIChannel. Channel ids are 6 x blocks from 0 and are closed when
	// Run returns: two channel runs at once on one runtime would collide
	// (transport.ErrChannelInUse); runs one after another are fine.
	GPUAPI string
	// WholeSweep sweeps each block whole before packing and sending its
	// faces. By default a block with neighbours on other ranks sweeps the
	// slabs next to them first (Block.Shell), sends those faces, and then
	// sweeps the rest, so that the faces travel while it computes; the
	// field and the residual are the same bits either way. Host fields
	// only: with GPU the device kernels sweep whole blocks.
	WholeSweep bool
	// Device is where the blocks live with GPU (nil: device 0 of
	// gpu.Default()). It should be the runtime's device (actor.Options),
	// where the runtime lands device payloads it has no buffer for.
	Device *gpu.Device
}

// Sweeps is S, the number of sweeps of a fixed-count run (the cap with Tol).
func (c *Config) Sweeps() int { return c.Warmup + c.Iters }

// MaxBlocks bounds the blocks of a run: each is an actor, with its fields.
const MaxBlocks = 1 << 24

// DefaultBlocks returns the default array shape for a job of ranks ranks
// with procs processors (GOMAXPROCS) in all.
//
// When every rank has one processor (procs == ranks) it is one block per
// rank: a rank's blocks then run one after the other, and more of them only
// add messages (grid 48, two ranks: 0.061-0.066 ms a sweep in 2 blocks,
// 0.070-0.071 in 8; four ranks on two cores: 0.41 against 0.45-0.46 ms;
// docs/jacobi3d.md, "Blocks"). Otherwise it is two blocks per processor, the
// same number on every rank, so that one computes while another waits for
// its faces (grid 48 on one rank of two processors: 0.087-0.089 ms a sweep
// in 1x1x2, 0.052-0.058 in 1x1x4).
//
// The blocks are arranged as evenly as their number factors (RankGrid, like
// MPI_Dims_create), the largest count along z and the smallest along x: z
// faces are contiguous planes and x faces one point per row, dearer to
// sweep first, pack and unpack, and splitting x shortens the rows the
// kernel runs along (grid 48 on two ranks: 0.050-0.055 ms a sweep in 1x1x2
// against 0.056-0.059 in 2x1x1; grid 96 on one rank of two processors:
// 0.28 in 1x2x2 against 0.41-0.43 in 2x2x2). Where the grid is too thin
// for that order, the other is tried, and then the same count f in every
// dimension, the smallest with f^3 >= the blocks wanted, capped by the grid;
// if that leaves fewer blocks than ranks, the ranks' count is spread over
// the dimensions that can take it, z first.
//
// A dimension of fewer than one point counts as one (Run refuses such a
// grid).
func DefaultBlocks(procs, ranks, nx, ny, nz int) [3]int {
	nx, ny, nz = max(nx, 1), max(ny, 1), max(nz, 1)
	n := ranks
	if procs != ranks {
		n = ranks * ((2*procs + ranks - 1) / ranks)
	}
	g := RankGrid(n)
	for _, o := range [][3]int{{g[2], g[1], g[0]}, g} {
		if o[0] <= nx && o[1] <= ny && o[2] <= nz {
			return o
		}
	}
	f := 1
	for f*f*f < n {
		f++
	}
	b := [3]int{min(f, nx), min(f, ny), min(f, nz)}
	if b[0]*b[1]*b[2] < ranks {
		// A thin grid (1x1x100 on four ranks): the blocks along the
		// dimensions that can take them, as many as the ranks at least.
		b = [3]int{1, 1, 1}
		left := ranks
		for _, d := range []int{2, 1, 0} {
			ext := [3]int{nx, ny, nz}[d]
			b[d] = min(ext, left)
			left = (left + b[d] - 1) / b[d]
		}
	}
	return b
}

// RankGrid factors n into three counts, largest first, as close to each
// other as n allows (what MPI_Dims_create gives): 2 -> 2x1x1, 4 -> 2x2x1,
// 6 -> 3x2x1, 12 -> 3x2x2.
func RankGrid(n int) [3]int {
	best := [3]int{n, 1, 1}
	for a := 1; a*a*a <= n; a++ {
		if n%a != 0 {
			continue
		}
		for b := a; a*b*b <= n; b++ {
			if (n/a)%b != 0 {
				continue
			}
			// a <= b <= c; the closer c is to a, the more even.
			if c := n / a / b; c-a < best[0]-best[2] {
				best = [3]int{c, b, a}
			}
		}
	}
	return best
}

// JobBlocks is DefaultBlocks for the job rt belongs to: the ranks
// exchange their GOMAXPROCS (a collective, under key jacobi.procs.name),
// so that all of them choose the same shape.
func JobBlocks(ctx context.Context, rt *actor.Runtime, name string, nx, ny, nz int) ([3]int, error) {
	all, err := rt.Transport().Bootstrap().AllGather(ctx, "jacobi.procs."+name, []byte(strconv.Itoa(runtime.GOMAXPROCS(0))))
	if err != nil {
		return [3]int{}, fmt.Errorf("jacobi: exchanging processor counts: %w", err)
	}
	procs := 0
	for r, v := range all {
		n, err := strconv.Atoi(string(v))
		if err != nil || n < 1 {
			return [3]int{}, fmt.Errorf("jacobi: rank %d reported %q processors", r, v)
		}
		procs += n
	}
	return DefaultBlocks(procs, len(all), nx, ny, nz), nil
}

// normalize fills defaults and validates c for a job of size ranks.
func (c *Config) normalize(ranks int) error {
	if c.Name == "" {
		c.Name = "jacobi3d"
	}
	if c.NX <= 0 || c.NY <= 0 || c.NZ <= 0 {
		return fmt.Errorf("jacobi: grid %dx%dx%d must be positive", c.NX, c.NY, c.NZ)
	}
	if c.Blocks == [3]int{} {
		return errors.New("jacobi: no block shape (Run fills in JobBlocks)")
	}
	n := [3]int{c.NX, c.NY, c.NZ}
	for d, b := range c.Blocks {
		if b <= 0 || b > n[d] {
			return fmt.Errorf("jacobi: %d blocks in dimension %d of a %d-point grid (want 1..%d)", b, d, n[d], n[d])
		}
	}
	// A block's two fields (halos included) must be allocatable: at most
	// 2^31 points each (16 GiB), computed without overflow; with Check,
	// so must the whole grid, which rank 0 computes serially.
	shapes := [][3]int{c.Blocks}
	if c.Check {
		shapes = append(shapes, [3]int{1, 1, 1}) // the whole grid as one block
	}
	for _, parts := range shapes {
		pts := int64(1)
		for d, b := range parts {
			side := int64((n[d]-1)/b + 3) // ceil(n/b) + 2, without overflow
			if pts > (1<<31)/side {
				return fmt.Errorf("jacobi: grid %dx%dx%d in %dx%dx%d blocks: a block (or, with -check, the whole grid) has more than 2^31 points",
					c.NX, c.NY, c.NZ, c.Blocks[0], c.Blocks[1], c.Blocks[2])
			}
			pts *= side
		}
	}
	if nb := int64(c.Blocks[0]) * int64(c.Blocks[1]); nb > MaxBlocks || nb*int64(c.Blocks[2]) > MaxBlocks {
		return fmt.Errorf("jacobi: %dx%dx%d blocks: more than %d", c.Blocks[0], c.Blocks[1], c.Blocks[2], MaxBlocks)
	}
	if nb := c.Blocks[0] * c.Blocks[1] * c.Blocks[2]; nb < ranks {
		return fmt.Errorf("jacobi: %d blocks for %d ranks: every rank needs at least one block", nb, ranks)
	}
	if c.Warmup < 0 || c.Iters < 0 || c.Sweeps() < 1 {
		return fmt.Errorf("jacobi: warm-up %d + iterations %d must be at least one sweep", c.Warmup, c.Iters)
	}
	switch {
	case c.ReduceEvery < 0:
		return fmt.Errorf("jacobi: reduce every %d sweeps", c.ReduceEvery)
	case c.ReduceEvery == 0:
		c.ReduceEvery = 1
	case c.ReduceEvery > c.Sweeps():
		// Once after the last sweep is what more means; the driver's
		// grants (twice the interval ahead) overflowed near 2^62.
		c.ReduceEvery = c.Sweeps()
	}
	if c.Tol < 0 || math.IsNaN(c.Tol) {
		return fmt.Errorf("jacobi: tolerance %g", c.Tol)
	}
	if !c.GPU {
		if c.GPUAPI != "" {
			return fmt.Errorf("jacobi: GPU API %q without GPU", c.GPUAPI)
		}
		return nil
	}
	switch c.GPUAPI {
	case "":
		c.GPUAPI = APIMessaging
	case APIMessaging, APIChannel:
	default:
		return fmt.Errorf("jacobi: GPU API %q: want %s or %s", c.GPUAPI, APIMessaging, APIChannel)
	}
	if nb := c.Blocks[0] * c.Blocks[1] * c.Blocks[2]; c.GPUAPI == APIChannel && nb*NumDirs > 1<<28 {
		return fmt.Errorf("jacobi: %d blocks need more than 2^28 channel ids", nb)
	}
	return nil
}

// Result is what Run reports on rank 0.
type Result struct {
	Sweeps    int     // sweeps done (S, or fewer with Tol)
	Residual  float64 // r of the last sweep
	FieldHash uint64  // field_hash of the final field
	// TimedSweeps is how many sweeps the timings cover: those after the
	// warm-up (all of them when the run ended within the warm-up).
	TimedSweeps int
	// IterMs is the median time per timed sweep, measured at the driver as
	// the time between residual reductions arriving at least IterWindow
	// sweeps apart (divided by the sweeps between them).
	IterMs float64
	// MeanIterMs is the timed wall time divided by TimedSweeps.
	MeanIterMs float64
	// CommMs is the time per timed sweep a rank spent with none of its
	// blocks computing (waiting for halos, the driver or message handling),
	// averaged over ranks.
	CommMs float64
	// CommShare is that idle time as a share of the ranks' timed wall time
	// (summed over ranks).
	CommShare float64
	// KernelMs is the kernel time (ghost unpacking, the sweep, face
	// packing) per timed sweep, summed over all blocks.
	KernelMs float64
	// Elapsed is the whole run at the driver, from the first Go to the
	// final reduction.
	Elapsed time.Duration
	// Checked is set when the field was compared with the serial
	// reference; then MaxAbsDiff, SerialResidual, SerialHash and Pass are
	// set. Pass: max |u - u_serial| <= 1e-12, the field hashes equal, and
	// so do the residuals (a max, the same whatever the reduction order).
	Checked        bool
	MaxAbsDiff     float64
	SerialResidual float64
	SerialHash     uint64
	Pass           bool
	// GPUAPI and GPUBackend say how a GPU run ran on rank 0: the halo API
	// and the gpu backend ("host" or "cuda"); empty without GPU.
	GPUAPI     string
	GPUBackend string
	// GPUIPC counts the halos rank 0 received by CUDA IPC (another process
	// of its host, cuda backend): through the Messaging API or channels.
	GPUIPC int64
}

// Halo is a block's boundary plane after sweep Iter, sent to the neighbour
// on that side. Dir is the face of the receiving block whose ghost plane it
// fills (XLow..ZHigh); Face holds its float64s, i-fastest, then j, then k,
// little-endian (faceBytes). Face is an actor.Payload: it travels as the
// active message's data, sent from the sender's face buffer and landing in
// the receiving runtime's pooled memory, without the msgpack encoding a
// []float64 would get (9 bytes and a byte swap per value, and new memory
// for every face received).
type Halo struct {
	Iter int
	Dir  int
	Face actor.Payload
}

// Go allows the blocks to compute sweeps up to Until; Last says Until is the
// final sweep.
type Go struct {
	Until int
	Last  bool
}

// Field carries a block's interior after the final sweep to the driver (for
// the check against the serial reference).
type Field struct {
	Linear int
	Data   []float64
}

// Done tells the blocks that the driver has all it needs: their rank may
// shut down.
type Done struct{}

func init() {
	actor.MustRegister[Halo]()
	actor.MustRegister[Go]()
	actor.MustRegister[Field]()
	actor.MustRegister[Done]()
}

// Run solves the problem described by cfg with an actor array of blocks on
// rt. It is collective: every rank calls it with the same cfg. Rank 0 hosts
// the driver and returns the Result; the other ranks return nil once the
// driver has everything. Run does not shut rt down.
func Run(ctx context.Context, rt *actor.Runtime, cfg Config) (*Result, error) {
	if cfg.Name == "" {
		cfg.Name = "jacobi3d"
	}
	if cfg.Blocks == [3]int{} && cfg.NX > 0 && cfg.NY > 0 && cfg.NZ > 0 {
		b, err := JobBlocks(ctx, rt, cfg.Name, cfg.NX, cfg.NY, cfg.NZ)
		if err != nil {
			return nil, err
		}
		cfg.Blocks = b
	}
	if err := cfg.normalize(rt.Size()); err != nil {
		return nil, err
	}
	rs := &rankState{ctx: ctx, warmup: cfg.Warmup, done: make(chan struct{}), errc: make(chan error, 1), idleFrom: time.Now()}
	if !cfg.GPU {
		return runBlocks(ctx, rt, cfg, rs)
	}
	dev, sten, err := gpuDevice(&cfg)
	if err != nil {
		return nil, err
	}
	rs.dev = &deviceRes{dev: dev, sten: sten}
	res, err := runBlocks(ctx, rt, cfg, rs)
	if rerr := rs.dev.release(); err == nil && rerr != nil {
		return nil, rerr
	}
	if res != nil {
		res.GPUAPI, res.GPUBackend = cfg.GPUAPI, dev.Backend()
		res.GPUIPC = int64(rt.Stats().DeviceIPC.Load()) + rt.Transport().GPUIPCStats().Received
	}
	return res, err
}

// runBlocks is Run after the configuration (and, with GPU, the device) is
// settled.
func runBlocks(ctx context.Context, rt *actor.Runtime, cfg Config, rs *rankState) (*Result, error) {
	dims := []int{cfg.Blocks[0], cfg.Blocks[1], cfg.Blocks[2]}
	nblocks := dims[0] * dims[1] * dims[2]
	for i := 0; i < nblocks; i++ {
		if actor.Block(nil, i, dims, rt.Size()) == rt.Rank() {
			rs.nlocal++
		}
	}
	driverPID := rt.PID(0, cfg.Name+"-driver")
	var results chan driverResult
	if rt.Rank() == 0 {
		results = make(chan driverResult, 1)
		d := &driver{rt: rt, cfg: cfg, nblocks: nblocks, out: results, times: map[int]time.Time{}}
		if _, err := rt.Root().SpawnNamed(rt.Props(func() pa.Actor { return d }), driverPID.Id); err != nil {
			return nil, fmt.Errorf("jacobi: spawning the driver: %w", err)
		}
		defer rt.Root().Stop(driverPID)
	}
	arr, err := rt.NewArray(ctx, actor.ArrayConfig{
		Name:      cfg.Name,
		Dims:      dims,
		Placement: actor.Block,
		New: func(el *actor.Element) pa.Actor {
			return newBlock(el, rt, &cfg, rs, driverPID)
		},
	})
	if err != nil {
		return nil, fmt.Errorf("jacobi: creating the block array: %w", err)
	}
	if rt.Rank() != 0 {
		return nil, rs.wait(ctx, rt)
	}
	if err := rt.Send(driverPID, &startRun{arr: arr}); err != nil {
		return nil, fmt.Errorf("jacobi: starting the driver: %w", err)
	}
	var res driverResult
	select {
	case res = <-results:
	case err := <-rs.errc:
		return nil, err
	case <-rt.Lost():
		return nil, lostErr(rt)
	case <-ctx.Done():
		return nil, fmt.Errorf("jacobi: waiting for the driver: %w", ctx.Err())
	}
	if res.err != nil {
		return nil, res.err
	}
	if err := arr.Broadcast(&Done{}); err != nil {
		return nil, fmt.Errorf("jacobi: broadcasting done: %w", err)
	}
	if err := rs.wait(ctx, rt); err != nil {
		return nil, err
	}
	out := res.res
	if cfg.Check {
		field, r := Serial(cfg.NX, cfg.NY, cfg.NZ, out.Sweeps)
		out.Checked = true
		out.SerialResidual = r
		out.SerialHash = HashField(field)
		for p, x := range field {
			out.MaxAbsDiff = max(out.MaxAbsDiff, math.Abs(x-res.field[p]))
		}
		out.Pass = out.MaxAbsDiff <= 1e-12 && out.SerialHash == out.FieldHash && out.Residual == out.SerialResidual
	}
	return &out, nil
}

// rankState is what a rank's blocks share: completion, errors, and the
// accounting of the time during which none of them computes.
type rankState struct {
	ctx    context.Context // the run's
	nlocal int
	warmup int
	dev    *deviceRes // GPU mode: the device and what the blocks allocate

	mu        sync.Mutex
	active    int           // blocks computing now
	idleFrom  time.Time     // when active last dropped to 0
	idle      time.Duration // time with active == 0, up to idleFrom
	marks     map[int]int   // sweep -> local blocks that finished it (0: started)
	t0        time.Time     // start of the timed window
	idle0     time.Duration // idle time at t0
	haveT0    bool
	tFirst    time.Time // start of the run on this rank (every block started)
	idleFirst time.Duration
	finished  int
	doneCount int

	done    chan struct{}
	errc    chan error
	errOnce sync.Once
}

// idleNow returns the idle time up to now; mu must be held.
func (rs *rankState) idleNow(now time.Time) time.Duration {
	if rs.active == 0 {
		return rs.idle + now.Sub(rs.idleFrom)
	}
	return rs.idle
}

// begin and end bracket a block's kernel; now is the time they are called
// (the kernel's own timing reads the clock already: a sweep of a small
// block is a few microseconds, and each clock read costs tens of
// nanoseconds on a virtual machine).
func (rs *rankState) begin(now time.Time) {
	rs.mu.Lock()
	if rs.active == 0 {
		rs.idle += now.Sub(rs.idleFrom)
	}
	rs.active++
	rs.mu.Unlock()
}

func (rs *rankState) end(now time.Time) {
	rs.mu.Lock()
	rs.active--
	if rs.active == 0 {
		rs.idleFrom = now
	}
	rs.mu.Unlock()
}

// mark records that a block finished sweep s (0: it started). When every
// local block has started, the run starts on this rank; when every local
// block has finished the warm-up, the timed window starts.
func (rs *rankState) mark(s int) {
	if s != 0 && s != rs.warmup {
		return
	}
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if rs.marks == nil {
		rs.marks = map[int]int{}
	}
	rs.marks[s]++
	if rs.marks[s] != rs.nlocal {
		return
	}
	now := time.Now()
	if s == 0 {
		rs.tFirst, rs.idleFirst = now, rs.idleNow(now)
	}
	if s == rs.warmup {
		rs.t0, rs.idle0, rs.haveT0 = now, rs.idleNow(now), true
	}
}

// finish records that a block did its last sweep. The last local block to
// finish gets the rank's idle and wall time over the timed window (or over
// the whole run when it ended within the warm-up) and last = true.
func (rs *rankState) finish() (idle, wall time.Duration, last bool) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	rs.finished++
	if rs.finished != rs.nlocal {
		return 0, 0, false
	}
	now := time.Now()
	t0, idle0 := rs.tFirst, rs.idleFirst
	if rs.haveT0 {
		t0, idle0 = rs.t0, rs.idle0
	}
	return rs.idleNow(now) - idle0, now.Sub(t0), true
}

// doneOne counts a block that heard Done; the last one releases the rank.
func (rs *rankState) doneOne() {
	rs.mu.Lock()
	rs.doneCount++
	n := rs.doneCount
	rs.mu.Unlock()
	if n == rs.nlocal {
		close(rs.done)
	}
}

// fail reports the rank's first error.
func (rs *rankState) fail(err error) {
	rs.errOnce.Do(func() { rs.errc <- err })
}

// wait waits until every local block heard Done, or an error, or a rank of
// the job is lost (its blocks' halos, or the driver's messages, will not
// come).
func (rs *rankState) wait(ctx context.Context, rt *actor.Runtime) error {
	select {
	case <-rs.done:
		return nil
	case err := <-rs.errc:
		return err
	case <-rt.Lost():
		select {
		case <-rs.done: // the run is over: the loss does not matter
			return nil
		default:
		}
		return lostErr(rt)
	case <-ctx.Done():
		return fmt.Errorf("jacobi: waiting for the run to finish: %w", ctx.Err())
	}
}

// lostErr is the error of a run that cannot go on because a rank was lost.
func lostErr(rt *actor.Runtime) error {
	return fmt.Errorf("jacobi: the run cannot go on: %w", rt.LostErr())
}

// block is one array element: a sub-grid with ghost layers.
type block struct {
	el     *actor.Element
	rt     *actor.Runtime
	cfg    *Config
	rs     *rankState
	driver *pa.PID
	self   *pa.PID
	geo    Block
	u, v   []float64        // the fields, without GPU
	dv     *devBlock        // the device state, with GPU
	nbr    [NumDirs]*pa.PID // neighbour on each side, nil at the global boundary
	need   int              // number of neighbours

	sweep   int // sweeps done: u holds the field after sweep
	granted int // the driver allows sweeps up to this
	final   int // the last sweep, 0 while unknown
	started bool
	done    bool // final sweep done and reported
	oneP    bool // GOMAXPROCS was 1 when the block was made
	failed  bool
	halos   haloRing // faces by iteration: the input of sweep Iter+1
	// out are the faces this block sends, by side and iteration parity.
	// The face of iteration s+2 is packed only after the neighbour has
	// unpacked that of s (our sweep s+2 needs its face of s+1, which it
	// sends after its sweep s+1, which unpacked ours of s), so two buffers
	// per side are enough, for a neighbour on this rank (which gets the
	// buffer itself) and on another alike.
	out [NumDirs][2][]float64
	// msgs are the Halo messages, by side and parity like out: a neighbour
	// on this rank gets the message itself and is done with it by the
	// same argument, one on another rank got it encoded by Send.
	msgs   [NumDirs][2]Halo
	remote [NumDirs]bool // the neighbour on that side is on another rank
	// early are the faces sent before the sweep is done: those for
	// another rank, unless WholeSweep. shell are their slabs, swept (and
	// the faces sent) before core, the rest. late are the other faces with
	// a neighbour, sent after the whole sweep.
	early, late [NumDirs]bool
	shell       []Part
	core        Part
	kernel      time.Duration // kernel time of sweeps after the warm-up
	kernelW     time.Duration // kernel time of warm-up sweeps
}

// haloRing holds the faces of the two iterations a block can have faces
// of: its current one and the next (a neighbour is at most one sweep
// ahead: its sweep s+2 needs our face of s+1). Kept in place, by iteration
// parity, so that receiving a face allocates nothing.
type haloRing [2]haloSet

// add returns the set for a face of iteration iter, which must be sweep
// (the iteration the block needs next) or sweep+1.
func (r *haloRing) add(iter, sweep int) (*haloSet, error) {
	if iter < sweep || iter > sweep+1 {
		return nil, fmt.Errorf("halo of iteration %d after sweep %d (a neighbour is at most one sweep ahead)", iter, sweep)
	}
	hs := &r[iter%2]
	if hs.n == 0 {
		hs.iter = iter
	}
	return hs, nil
}

// current returns the faces of iteration sweep, nil if none came yet.
func (r *haloRing) current(sweep int) *haloSet {
	if hs := &r[sweep%2]; hs.n > 0 && hs.iter == sweep {
		return hs
	}
	return nil
}

// done empties the set of iteration sweep once its faces are used.
func (r *haloRing) done(sweep int) { r[sweep%2] = haloSet{} }

// haloSet collects the faces of one iteration.
type haloSet struct {
	iter  int
	faces [NumDirs][]float64
	land  [NumDirs]actor.Payload // faces the runtime landed: released once unpacked
	dev   [NumDirs]gpu.Buffer    // GPU mode: device faces
	owned [NumDirs]bool          // dev[d] was allocated for us: free after use
	n     int
}

func newBlock(el *actor.Element, rt *actor.Runtime, cfg *Config, rs *rankState, driver *pa.PID) *block {
	ix, iy, iz := el.Index[0], el.Index[1], el.Index[2]
	geo := NewBlock(BlockBox(cfg.NX, cfg.NY, cfg.NZ, cfg.Blocks, ix, iy, iz))
	b := &block{el: el, rt: rt, cfg: cfg, rs: rs, driver: driver, self: selfPID(el), geo: geo,
		oneP: runtime.GOMAXPROCS(0) == 1}
	a := el.Array
	b.nbr = [NumDirs]*pa.PID{
		a.Element(ix-1, iy, iz), a.Element(ix+1, iy, iz),
		a.Element(ix, iy-1, iz), a.Element(ix, iy+1, iz),
		a.Element(ix, iy, iz-1), a.Element(ix, iy, iz+1),
	}
	for d, p := range b.nbr {
		if p != nil {
			b.need++
			b.remote[d] = actor.RankOf(p) != rt.Rank()
		}
	}
	if cfg.GPU {
		if err := b.initDevice(); err != nil {
			b.fail(fmt.Errorf("device setup: %w", err))
		}
		return b
	}
	b.u, b.v = make([]float64, geo.Len()), make([]float64, geo.Len())
	for d, p := range b.nbr {
		// Faces for another rank go out early: they have a trip to
		// make. A neighbour on this rank gets its face as a pointer;
		// sweeping a slab apart only costs (grid 48 on one rank of two
		// processors, 2x2x2: 0.082 against 0.074 ms a sweep).
		b.early[d] = b.remote[d] && !cfg.WholeSweep
		b.late[d] = p != nil && !b.early[d]
	}
	b.shell, b.core = geo.Shell(b.early)
	for d, p := range b.nbr {
		if p == nil {
			// Global boundary: the ghost plane holds the fixed value for good.
			geo.FillGhost(b.u, d, BoundaryValue(d))
			geo.FillGhost(b.v, d, BoundaryValue(d))
		}
	}
	return b
}

// Receive implements protoactor's Actor.
func (b *block) Receive(c pa.Context) {
	if b.failed {
		return
	}
	switch m := c.Message().(type) {
	case *Go:
		if m.Until > b.granted {
			b.granted = m.Until
		}
		if m.Last {
			b.final = m.Until
		}
		switch {
		case !b.started && b.dv != nil:
			b.started = true
			b.rs.mark(0)
			if err := b.sendInitialFaces(); err != nil {
				b.fail(err)
				return
			}
		case !b.started:
			b.started = true
			b.rs.mark(0)
			b.sendFaces()
		case b.dv != nil:
			if err := b.flushDevice(); err != nil {
				b.fail(err)
				return
			}
		}
		b.step()
	case *DeviceHalo:
		if err := b.addDeviceHalo(m.Iter, m.Dir, m.Face); err != nil {
			b.fail(err)
			return
		}
		b.step()
	case *chanHalo:
		err := m.Err
		if err == nil {
			err = b.addDeviceHalo(m.Iter, m.Dir, b.dv.recv[m.Dir][m.Iter%2])
		}
		if err != nil {
			b.fail(fmt.Errorf("halo %d of iteration %d: %w", m.Dir, m.Iter, err))
			return
		}
		b.step()
	case *Halo:
		if err := b.addHalo(m); err != nil {
			b.fail(err)
			return
		}
		b.step()
	case *Done:
		b.rs.doneOne()
	}
}

func (b *block) fail(err error) {
	b.failed = true
	b.rs.fail(fmt.Errorf("jacobi: block %v: %w", b.el.Index, err))
}

// addHalo buffers a face by iteration: a neighbour may be one sweep ahead,
// so faces of iteration sweep+1 can arrive before those of sweep.
func (b *block) addHalo(m *Halo) error {
	if b.dv != nil {
		return fmt.Errorf("host halo for face %d, but this run keeps its fields on the device", m.Dir)
	}
	if m.Dir < 0 || m.Dir >= NumDirs || b.nbr[m.Dir] == nil {
		return fmt.Errorf("halo for face %d, which has no neighbour", m.Dir)
	}
	if n := b.geo.FaceLen(m.Dir); len(m.Face) != 8*n {
		return fmt.Errorf("halo for face %d has %d bytes, want %d (%d points)", m.Dir, len(m.Face), 8*n, n)
	}
	hs, err := b.halos.add(m.Iter, b.sweep)
	if err != nil {
		return fmt.Errorf("face %d: %w", m.Dir, err)
	}
	if hs.faces[m.Dir] != nil {
		return fmt.Errorf("two halos of iteration %d for face %d", m.Iter, m.Dir)
	}
	hs.faces[m.Dir] = faceFloats(m.Face)
	if b.remote[m.Dir] {
		// Landed by the runtime in its pool; from a neighbour on this
		// rank it is that block's own buffer.
		hs.land[m.Dir] = m.Face
	}
	hs.n++
	return nil
}

// step does every sweep the block can do now (allowed by the driver, with
// all the faces of the current iteration in), and finishes after the last.
func (b *block) step() {
	for b.canStep() {
		if b.final > 0 && b.sweep >= b.final {
			b.finish()
			return
		}
		hs := b.halos.current(b.sweep)
		if b.dv != nil {
			if !b.deviceSweep(hs) {
				return
			}
			continue
		}
		start := time.Now()
		b.rs.begin(start)
		if hs != nil {
			for d, f := range hs.faces {
				if f != nil {
					// Lengths were checked in addHalo.
					_ = b.geo.UnpackFace(b.u, d, f)
				}
				if hs.land[d] != nil {
					actor.ReleasePayload(hs.land[d])
				}
			}
			b.halos.done(b.sweep)
		}
		old, nw := b.u, b.v
		b.sweep++
		last := b.final > 0 && b.sweep == b.final
		r, rest := 0.0, b.geo.Whole()
		if !last && len(b.shell) > 0 {
			// The early faces first: their slabs, packed and sent while
			// the rest of the block is swept (the neighbours' next
			// sweeps wait for them, this block's rest waits for nothing).
			for _, p := range b.shell {
				r = b.geo.SweepPart(old, nw, p, r)
			}
			faces := b.packFaces(nw, b.early)
			b.addKernel(time.Since(start))
			b.send(faces)
			start, rest = time.Now(), b.core
		}
		r = b.geo.SweepPart(old, nw, rest, r)
		b.u, b.v = nw, old
		var faces [NumDirs][]float64
		if !last {
			faces = b.packFaces(nw, b.late)
		}
		now := time.Now()
		b.addKernel(now.Sub(start))
		b.rs.end(now)
		if !last {
			b.send(faces)
		}
		if b.sweep%b.cfg.ReduceEvery == 0 || last {
			b.contribute([]float64{r, float64(b.sweep)}, actor.Max)
		}
		b.rs.mark(b.sweep)
		if b.oneP && b.canStep() {
			// With one processor, let the goroutines this sweep made
			// runnable (the array's manager with the contribution, the
			// driver, the progress loop) run before the next: a block
			// that could always go on (one block, no neighbours) kept the
			// processor for the whole run (its mailbox yields only every
			// 300 messages), and the driver saw every residual at the
			// end. With more processors they run elsewhere, and yielding
			// cost a third more time a sweep (grid 48, one rank of two).
			runtime.Gosched()
		}
	}
}

// canStep reports whether step would do something now: finish, or sweep.
func (b *block) canStep() bool {
	switch {
	case b.failed || b.done:
		return false
	case b.final > 0 && b.sweep >= b.final:
		return true
	case b.sweep >= b.granted:
		return false
	}
	hs := b.halos.current(b.sweep)
	return b.need == 0 || hs != nil && hs.n >= b.need
}

// deviceSweep is step's body in GPU mode: one sweep on the device with the
// faces hs, then the faces out and the residual contributed. It reports
// whether the block may go on.
func (b *block) deviceSweep(hs *haloSet) bool {
	last := b.final > 0 && b.sweep+1 == b.final
	if !last {
		// The faces packed two sweeps ago, in the buffers this sweep packs
		// into, must have left.
		if err := b.waitSends((b.sweep + 1) % 2); err != nil {
			b.fail(err)
			return false
		}
	}
	start := time.Now()
	b.rs.begin(start)
	r, err := b.deviceStep(hs, last)
	b.halos.done(b.sweep)
	b.sweep++
	now := time.Now()
	b.addKernel(now.Sub(start))
	b.rs.end(now)
	if err != nil {
		b.fail(err)
		return false
	}
	if !last {
		b.dv.pending = b.sweep
		if err := b.flushDevice(); err != nil {
			b.fail(err)
			return false
		}
	}
	if b.sweep%b.cfg.ReduceEvery == 0 || last {
		b.contribute([]float64{r, float64(b.sweep)}, actor.Max)
	}
	b.rs.mark(b.sweep)
	return !b.failed
}

// addKernel counts el as kernel time of the sweep just done (b.sweep).
func (b *block) addKernel(el time.Duration) {
	if b.sweep > b.cfg.Warmup {
		b.kernel += el
	} else {
		b.kernelW += el
	}
}

// packFaces copies the planes of the faces marked in which out of u, into
// the send buffers of the current sweep's parity.
func (b *block) packFaces(u []float64, which [NumDirs]bool) [NumDirs][]float64 {
	var faces [NumDirs][]float64
	for d := range b.nbr {
		if !which[d] {
			continue
		}
		f := &b.out[d][b.sweep%2]
		if *f == nil {
			*f = make([]float64, b.geo.FaceLen(d))
		}
		_ = b.geo.PackFaceTo(*f, u, d) // the length is right
		faces[d] = *f
	}
	return faces
}

// sendFaces sends the current field's faces (used for sweep 0).
func (b *block) sendFaces() {
	b.rs.begin(time.Now())
	var all [NumDirs]bool
	for d, p := range b.nbr {
		all[d] = p != nil
	}
	faces := b.packFaces(b.u, all)
	b.rs.end(time.Now())
	b.send(faces)
}

// send sends each face d given to the neighbour on side d, where it fills
// the opposite face's ghost plane.
func (b *block) send(faces [NumDirs][]float64) {
	for d, p := range b.nbr {
		if p == nil || faces[d] == nil {
			continue
		}
		m := &b.msgs[d][b.sweep%2]
		*m = Halo{Iter: b.sweep, Dir: d ^ 1, Face: faceBytes(faces[d])}
		if err := b.rt.Send(p, m); err != nil {
			b.fail(fmt.Errorf("sending halo %d of iteration %d: %w", d, b.sweep, err))
			return
		}
	}
}

func (b *block) contribute(v any, op string) {
	if err := b.el.Contribute(v, op, b.driver); err != nil {
		b.fail(fmt.Errorf("contributing to the reduction after sweep %d: %w", b.sweep, err))
	}
}

// finish reports the final field: its hash share, the block's and rank's
// timings, and (when checking) the interior itself.
func (b *block) finish() {
	b.done = true
	// The rank's timed window ends with its last sweep, not after the field
	// is read back and hashed (a large -gpu block spends longer on that
	// than on its sweeps).
	idle, wall, last := b.rs.finish()
	u := b.u
	if b.dv != nil {
		// The sends of the last faces must have left before Run frees them.
		err := b.waitSends(-1)
		if err == nil {
			u, err = b.deviceField()
		}
		if err != nil {
			b.fail(err)
			return
		}
	}
	b.contribute(b.geo.HashPartial(u, b.cfg.NX, b.cfg.NY), actor.Sum)
	stats := []float64{b.kernel.Seconds(), b.kernelW.Seconds(), 0, 0, 0}
	if last {
		stats[2], stats[3], stats[4] = idle.Seconds(), wall.Seconds(), 1
	}
	b.contribute(stats, actor.Sum)
	if b.cfg.Check {
		if err := b.rt.Send(b.driver, &Field{Linear: b.el.Linear, Data: b.geo.Interior(u)}); err != nil {
			b.fail(fmt.Errorf("sending the field: %w", err))
		}
	}
}

// startRun hands the driver the array (a local message, never encoded).
type startRun struct{ arr *actor.Array }

// driverResult is what the driver hands Run.
type driverResult struct {
	res   Result
	field []float64
	err   error
}

// driver runs on rank 0: it lets the blocks go, takes the reductions,
// decides when to stop (Tol) and gathers the result.
type driver struct {
	rt      *actor.Runtime
	cfg     Config
	nblocks int
	arr     *actor.Array
	out     chan<- driverResult
	sent    bool

	start    time.Time
	granted  int
	final    int
	times    map[int]time.Time // arrival of each sweep's residual
	residual float64
	haveRes  bool
	hash     uint64
	haveHash bool
	stats    []float64
	field    []float64
	fields   int
}

// Receive implements protoactor's Actor.
func (d *driver) Receive(c pa.Context) {
	if d.sent {
		return
	}
	var err error
	switch m := c.Message().(type) {
	case *startRun:
		err = d.begin(m.arr)
	case *actor.Reduced:
		err = d.reduced(m)
	case *Field:
		err = d.addField(m)
	default:
		return
	}
	if err != nil {
		d.sent = true
		d.out <- driverResult{err: err}
		return
	}
	d.maybeDone()
}

func (d *driver) begin(arr *actor.Array) error {
	d.arr = arr
	d.start = time.Now()
	if d.cfg.Check {
		d.field = make([]float64, d.cfg.NX*d.cfg.NY*d.cfg.NZ)
	}
	s := d.cfg.Sweeps()
	if d.cfg.Tol == 0 {
		return d.grant(s, true)
	}
	// Blocks may run one reduction interval ahead of the driver's decision.
	g := min(2*d.cfg.ReduceEvery, s)
	return d.grant(g, g == s)
}

func (d *driver) grant(until int, last bool) error {
	d.granted = until
	if last {
		d.final = until
	}
	if err := d.arr.Broadcast(&Go{Until: until, Last: last}); err != nil {
		return fmt.Errorf("jacobi: letting the blocks go to sweep %d: %w", until, err)
	}
	return nil
}

func (d *driver) reduced(m *actor.Reduced) error {
	v, err := m.Result()
	if err != nil {
		return err
	}
	switch x := v.(type) {
	case uint64:
		d.hash, d.haveHash = x, true
		return nil
	case []float64:
		if m.Op == actor.Sum {
			d.stats = x
			return nil
		}
		if len(x) != 2 {
			return fmt.Errorf("jacobi: residual reduction of %d values", len(x))
		}
		return d.residualAt(int(x[1]), x[0])
	}
	return fmt.Errorf("jacobi: unexpected reduction result %T (round %d)", v, m.Round)
}

// residualAt takes the residual of sweep s and, with Tol, decides whether
// to go on.
func (d *driver) residualAt(s int, r float64) error {
	d.times[s] = time.Now()
	if d.final > 0 {
		if s == d.final {
			d.residual, d.haveRes = r, true
		}
		return nil
	}
	if r <= d.cfg.Tol {
		// The blocks may already be working up to the granted sweep: that
		// is where they stop.
		return d.grant(d.granted, true)
	}
	g := min(s+2*d.cfg.ReduceEvery, d.cfg.Sweeps())
	if g <= d.granted {
		return nil
	}
	return d.grant(g, g == d.cfg.Sweeps())
}

func (d *driver) addField(m *Field) error {
	if !d.cfg.Check || m.Linear < 0 || m.Linear >= d.nblocks {
		return fmt.Errorf("jacobi: unexpected field of block %d", m.Linear)
	}
	idx := d.arr.IndexOf(m.Linear)
	box := BlockBox(d.cfg.NX, d.cfg.NY, d.cfg.NZ, d.cfg.Blocks, idx[0], idx[1], idx[2])
	if len(m.Data) != box.NX*box.NY*box.NZ {
		return fmt.Errorf("jacobi: field of block %v has %d points, want %d", idx, len(m.Data), box.NX*box.NY*box.NZ)
	}
	p := 0
	for k := 0; k < box.NZ; k++ {
		for j := 0; j < box.NY; j++ {
			at := box.X0 + d.cfg.NX*((box.Y0+j)+d.cfg.NY*(box.Z0+k))
			copy(d.field[at:at+box.NX], m.Data[p:p+box.NX])
			p += box.NX
		}
	}
	d.fields++
	return nil
}

// IterWindow is the fewest sweeps Result.IterMs measures at a time. The
// driver timestamps a reduction when its mailbox runs, and the blocks do
// not wait for it: a driver that fell behind handled several reductions in
// a row, microseconds apart, and a median over single sweeps then came out
// far below the real sweep time (0.0014 ms for a 0.05 ms sweep, 2026-11-24).
const IterWindow = 10

// maybeDone hands Run the result once everything is in.
func (d *driver) maybeDone() {
	if !d.haveRes || !d.haveHash || d.stats == nil || (d.cfg.Check && d.fields < d.nblocks) {
		return
	}
	d.sent = true
	end := d.times[d.final]
	res := Result{Sweeps: d.final, Residual: d.residual, FieldHash: FieldHash(d.hash), Elapsed: end.Sub(d.start)}
	// Timed sweeps are those after the warm-up, or all of them when the run
	// ended within it (then the blocks' warm-up kernel time counts too).
	w := d.cfg.Warmup
	kernel := d.stats[0]
	if w >= d.final {
		w, kernel = 0, d.stats[0]+d.stats[1]
	}
	res.TimedSweeps = d.final - w
	res.KernelMs = kernel * 1e3 / float64(res.TimedSweeps)
	// The driver's clock starts at the last reduction within the warm-up
	// (the start of the run when there is none; the same as the warm-up's
	// end when ReduceEvery divides it).
	tw, tws := d.start, 0
	for s, t := range d.times {
		if s <= w && s > tws {
			tw, tws = t, s
		}
	}
	w = tws
	res.MeanIterMs = ms(end.Sub(tw)) / float64(d.final-w)
	// Per-sweep times between reductions at least IterWindow sweeps apart
	// in the timed window (the last one may be shorter).
	var per []float64
	prev, tp := w, tw
	var sweeps []int
	for s := range d.times {
		if s > w {
			sweeps = append(sweeps, s)
		}
	}
	slices.Sort(sweeps)
	for i, s := range sweeps {
		if s-prev < IterWindow && i < len(sweeps)-1 {
			continue
		}
		per = append(per, ms(d.times[s].Sub(tp))/float64(s-prev))
		prev, tp = s, d.times[s]
	}
	slices.Sort(per)
	if n := len(per); n > 0 {
		res.IterMs = per[n/2]
		if n%2 == 0 {
			res.IterMs = (per[n/2-1] + per[n/2]) / 2
		}
	}
	idle, wall, ranks := d.stats[2], d.stats[3], d.stats[4]
	if wall > 0 && ranks > 0 {
		res.CommShare = idle / wall
		res.CommMs = idle * 1e3 / ranks / float64(res.TimedSweeps)
	}
	d.out <- driverResult{res: res, field: d.field}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
