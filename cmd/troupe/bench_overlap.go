package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/overlap"
	"github.com/troupe-hpc/troupe/transport"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
	"github.com/troupe-hpc/troupe/transport/perf"
)

type overlapFlags struct {
	tls         string
	json        bool
	minSize     int
	maxSize     int
	scale       float64
	rounds      int
	calibrate   bool
	gatherRanks int
	gatherSize  int
	gatherDelay time.Duration
	typed       bool
	latencyOnly bool
	engine      string // per rank (internal): on or off
}

// overlapRow is one line of the overlap table (the JSON row, plus
// the times it was computed from).
type overlapRow struct {
	Size       int     `json:"size"`
	Mode       string  `json:"mode"`
	Engine     string  `json:"engine"`
	OverlapPct float64 `json:"overlap_pct"`
	TCommUs    float64 `json:"t_comm_us"`
	TComputeUs float64 `json:"t_compute_us"`
	TTotalUs   float64 `json:"t_total_us"`
	// SenderUs is the sender's mean time from Isend to its completion.
	SenderUs float64 `json:"sender_us"`
}

// overlapExtra is a latency or gather row, or the calibration of a job.
type overlapExtra struct {
	Bench  string `json:"bench"` // latency, gather or calibration
	Engine string `json:"engine"`
	Size   int    `json:"size,omitempty"`
	// latency
	LatUs float64 `json:"lat_us,omitempty"`
	// gather
	Ranks       int     `json:"ranks,omitempty"`
	RootDelayUs float64 `json:"root_delay_us,omitempty"`
	SenderUs    float64 `json:"sender_us,omitempty"`
	RootUs      float64 `json:"root_us,omitempty"`
	// calibration
	AlphaNsPerB float64 `json:"alpha_ns_per_byte,omitempty"`
	BetaUs      float64 `json:"beta_us,omitempty"`
	R2          float64 `json:"r2,omitempty"`
	// engine counters at the end of the job
	Stats *overlap.Stats `json:"stats,omitempty"`
}

// overlapLine is what a rank writes to the results file: one of the two.
type overlapLine struct {
	Row   *overlapRow   `json:"row,omitempty"`
	Extra *overlapExtra `json:"extra,omitempty"`
}

func newOverlapCmd() *cobra.Command {
	var f overlapFlags
	cmd := &cobra.Command{
		Use:   "overlap",
		Short: "Receiver-side computation/communication overlap, engine on and off (OSU style), and a skewed gather",
		Long: `overlap starts two-rank jobs with the overlap engine off and on and measures,
for 64 KiB ... 4 MiB, how much of a message's transfer hides behind the
receiver's computation: the receiver posts the receive, computes for about
the pure communication time without calling the transport, then waits.
overlap% = 100 x (1 - (t_total - t_compute) / t_comm), clamped at 0 as OSU
does. Each row is one round (job) of --rounds, the one whose overlap% is
the median (the lower middle one of an even number), so that its times
give its overlap%. Mode expected: the receive is posted before the message is sent.
Mode unexpected: the receiver is late; the message arrives while it computes
before posting the receive. The 8 B latency is measured in the same jobs.
Then a skewed gather (rank 0 late by --gather-delay, the others send to it)
shows how long the senders wait for the late root, engine off and on.`,
		Args: cobra.NoArgs,
	}
	fl := cmd.Flags()
	fl.StringVar(&f.tls, "tls", "shm", "UCX transports: shm, tcp, or a UCX_TLS value")
	fl.BoolVar(&f.json, "json", false, `print one JSON object per row: {"size":...,"mode":"expected|unexpected","engine":"on|off","overlap_pct":...,"t_comm_us":...}`)
	fl.IntVar(&f.minSize, "min", 64<<10, "smallest message size in bytes")
	fl.IntVar(&f.maxSize, "max", 4<<20, "largest message size in bytes")
	fl.Float64Var(&f.scale, "scale", 1, "iteration count multiplier (positive, finite)")
	fl.IntVar(&f.rounds, "rounds", 3, "jobs per engine setting, interleaved off/on; each row is the round of median overlap%")
	fl.BoolVar(&f.calibrate, "calibrate", true, "fit the engine's alpha and beta with a short ping-pong at start-up")
	fl.IntVar(&f.gatherRanks, "gather-ranks", 3, "ranks of the skewed gather, root included: 0 skips it, else at least 2")
	fl.IntVar(&f.gatherSize, "gather-size", 1<<20, "bytes each sender contributes to the gather")
	fl.DurationVar(&f.gatherDelay, "gather-delay", 2*time.Millisecond, "how late the gather's root is (0 or more)")
	fl.BoolVar(&f.typed, "typed", false, "send typed (derived-datatype) messages instead of bytes: a vector of 1 KiB blocks at a 2 KiB stride, size packed bytes (--min a multiple of 1024), the adaptive scheme")
	fl.BoolVar(&f.latencyOnly, "latency-only", false, "skip the size sweep: only the 8 B latency (and the gather, unless --gather-ranks 0)")
	fl.StringVar(&f.engine, "engine", "off", "overlap engine of this rank (internal)")
	_ = fl.MarkHidden("engine")
	setBenchRun(cmd, func(ctx context.Context) error { return overlapRank(ctx, f) },
		func(ctx context.Context, out io.Writer) error {
			if err := checkSizes(f.minSize, f.maxSize); err != nil && !f.latencyOnly {
				return err
			}
			if err := checkCounts("--scale", f.scale, "--rounds", f.rounds); err != nil {
				return err
			}
			// Every size of the sweep is --min doubled: it packs exactly
			// that many bytes when --min is a whole number of blocks.
			if f.typed && f.minSize%ovTypedBlock != 0 {
				return fmt.Errorf("--typed with --min %d: want a multiple of %d (typed messages are vectors of 1 KiB blocks)", f.minSize, ovTypedBlock)
			}
			// A gather needs its root and at least one sender.
			if f.gatherRanks < 0 || f.gatherRanks == 1 {
				return fmt.Errorf("--gather-ranks %d: want 0 (no gather) or at least 2 (the root and its senders)", f.gatherRanks)
			}
			if f.gatherDelay < 0 {
				return fmt.Errorf("--gather-delay %v: want 0 or more (how late the root is)", f.gatherDelay)
			}
			if f.gatherRanks > 1 && (f.gatherSize < 1 || f.gatherSize > maxBenchSize) {
				return fmt.Errorf("--gather-size %d: want 1 to %d", f.gatherSize, maxBenchSize)
			}
			return overlapRun(ctx, out, f)
		})
	return cmd
}

func init() { benchCmd.AddCommand(newOverlapCmd()) }

// overlapJob launches n ranks of this executable in one role and returns
// rank 0's lines.
func overlapJob(ctx context.Context, f overlapFlags, n int, engine, role string) ([]overlapLine, error) {
	rows, err := runBenchJob[overlapLine](ctx, n, f.tls, 0, []string{"bench", "overlap", "--as-rank", "--engine", engine,
		"--min", strconv.Itoa(f.minSize), "--max", strconv.Itoa(f.maxSize),
		"--scale", strconv.FormatFloat(f.scale, 'g', -1, 64),
		"--calibrate=" + strconv.FormatBool(f.calibrate),
		"--gather-size", strconv.Itoa(f.gatherSize), "--gather-delay", f.gatherDelay.String(),
		"--typed=" + strconv.FormatBool(f.typed), "--latency-only=" + strconv.FormatBool(f.latencyOnly),
		"--gather-ranks", role}, nil)
	if err != nil {
		return nil, fmt.Errorf("overlap job (engine %s): %w", engine, err)
	}
	return rows, nil
}

// overlapRun runs the rounds and prints the medians.
func overlapRun(ctx context.Context, out io.Writer, f overlapFlags) error {
	if f.rounds < 1 {
		f.rounds = 1
	}
	res := newOverlapResults()
	for round := 0; round < f.rounds; round++ {
		for _, engine := range []string{"off", "on"} {
			lines, err := overlapJob(ctx, f, 2, engine, "0")
			if err != nil {
				return err
			}
			if f.gatherRanks > 1 {
				g, err := overlapJob(ctx, f, f.gatherRanks, engine, strconv.Itoa(f.gatherRanks))
				if err != nil {
					return err
				}
				lines = append(lines, g...)
			}
			res.add(engine, lines)
		}
	}
	return res.print(out, f)
}

// overlapKey names one row of the overlap table.
type overlapKey struct {
	size         int
	mode, engine string
}

// overlapResults gathers the lines of every job of a run.
type overlapResults struct {
	rows   map[overlapKey][]overlapRow
	order  []overlapKey
	lat    map[string][]float64
	gather map[string][]overlapExtra
	calib  []overlapExtra
	stats  *overlap.Stats // the engine's counters of the last job that reported them
}

func newOverlapResults() *overlapResults {
	return &overlapResults{rows: map[overlapKey][]overlapRow{}, lat: map[string][]float64{}, gather: map[string][]overlapExtra{}}
}

// add takes the lines of one job run with the engine setting engine.
func (res *overlapResults) add(engine string, lines []overlapLine) {
	for _, l := range lines {
		switch {
		case l.Row != nil:
			k := overlapKey{l.Row.Size, l.Row.Mode, l.Row.Engine}
			if _, ok := res.rows[k]; !ok {
				res.order = append(res.order, k)
			}
			res.rows[k] = append(res.rows[k], *l.Row)
		case l.Extra != nil && l.Extra.Bench == "latency":
			res.lat[engine] = append(res.lat[engine], l.Extra.LatUs)
		case l.Extra != nil && l.Extra.Bench == "gather":
			res.gather[engine] = append(res.gather[engine], *l.Extra)
		case l.Extra != nil && l.Extra.Bench == "calibration":
			res.calib = append(res.calib, *l.Extra)
		case l.Extra != nil && l.Extra.Bench == "stats" && l.Extra.Stats != nil:
			res.stats = l.Extra.Stats
		}
	}
}

// print writes the table (or with f.json the JSON rows) of the results.
func (res *overlapResults) print(out io.Writer, f overlapFlags) error {
	order := slices.Clone(res.order)
	sort.SliceStable(order, func(i, j int) bool {
		a, b := order[i], order[j]
		if a.mode != b.mode {
			return a.mode < b.mode
		}
		if a.size != b.size {
			return a.size < b.size
		}
		return a.engine < b.engine
	})
	var final []overlapRow
	for _, k := range order {
		final = append(final, medianRound(res.rows[k]))
	}
	gmed := func(engine string, get func(overlapExtra) float64) float64 {
		xs := []float64{}
		for _, g := range res.gather[engine] {
			xs = append(xs, get(g))
		}
		return median(xs)
	}
	if f.json {
		enc := json.NewEncoder(out)
		for _, r := range final {
			if err := enc.Encode(r); err != nil {
				return err
			}
		}
		for _, e := range []string{"off", "on"} {
			if err := enc.Encode(overlapExtra{Bench: "latency", Engine: e, Size: 8, LatUs: median(res.lat[e])}); err != nil {
				return err
			}
			if len(res.gather[e]) > 0 {
				g := res.gather[e][0]
				g.SenderUs = gmed(e, func(x overlapExtra) float64 { return x.SenderUs })
				g.RootUs = gmed(e, func(x overlapExtra) float64 { return x.RootUs })
				g.Stats = nil
				if err := enc.Encode(g); err != nil {
					return err
				}
			}
		}
		return nil
	}
	what := ""
	if f.typed {
		what = ", typed messages (vector of 1 KiB blocks, stride 2 KiB)"
	}
	fmt.Fprintf(out, "# troupe overlap, 2 ranks, UCX_TLS=%s%s, %d round(s) per engine setting (each row: the round of median overlap%%; latency and gather: medians)\n", bootstrap.UCXTLS(f.tls), what, f.rounds)
	fmt.Fprintf(out, "# rank 1 (sender) waits parked, without spinning (docs/overlap.md, section 8)\n")
	// The ranks inherit this process's environment and CPUs, so they get
	// the GOMAXPROCS it has.
	if p := runtime.GOMAXPROCS(0); p == 1 {
		fmt.Fprintf(out, "# GOMAXPROCS 1 in each rank: the progress goroutine cannot run while the receiver computes, so expect no overlap (docs/overlap.md, \"One P per rank\")\n")
	} else {
		fmt.Fprintf(out, "# GOMAXPROCS %d in each rank\n", p)
	}
	for _, c := range res.calib {
		fmt.Fprintf(out, "# calibration: alpha %.4f ns/B, beta %.1f us, R2 %.3f\n", c.AlphaNsPerB, c.BetaUs, c.R2)
	}
	fmt.Fprintf(out, "%-10s %-10s %-6s %9s %11s %13s %11s %11s\n", "# mode", "size", "engine", "overlap%", "t_comm(us)", "t_compute(us)", "t_total(us)", "sender(us)")
	for _, r := range final {
		fmt.Fprintf(out, "%-10s %-10s %-6s %9.1f %11.1f %13.1f %11.1f %11.1f\n", r.Mode, perf.FormatSize(r.Size), r.Engine,
			r.OverlapPct, r.TCommUs, r.TComputeUs, r.TTotalUs, r.SenderUs)
	}
	lOff, lOn := median(res.lat["off"]), median(res.lat["on"])
	fmt.Fprintf(out, "# 8 B one-way latency: engine off %.3f us, on %.3f us (on/off %.1f%%, target <= 105%%)\n", lOff, lOn, 100*lOn/lOff)
	if ratios := roundRatios(res.lat["on"], res.lat["off"]); len(ratios) > 1 {
		fmt.Fprintf(out, "# 8 B on/off per round (jobs alternate off, on):")
		for _, r := range ratios {
			fmt.Fprintf(out, " %.1f", r)
		}
		fmt.Fprintf(out, " %%; median %.1f%%\n", median(ratios))
	}
	if len(res.gather["off"]) > 0 {
		fmt.Fprintf(out, "# skewed gather: %d ranks, %s per sender, root late by %v\n", f.gatherRanks, perf.FormatSize(f.gatherSize), f.gatherDelay)
		fmt.Fprintf(out, "%-8s %22s %14s\n", "# engine", "sender send time (us)", "root time (us)")
		for _, e := range []string{"off", "on"} {
			fmt.Fprintf(out, "%-8s %22.1f %14.1f\n", e, gmed(e, func(x overlapExtra) float64 { return x.SenderUs }),
				gmed(e, func(x overlapExtra) float64 { return x.RootUs }))
		}
	}
	if st := res.stats; st != nil {
		fmt.Fprintf(out, "# engine counters (rank 0, last job with the engine on): offloaded %d onloaded %d prefetched %d eager %d, prefetch useful %d useless %d, pool high water %d/%d\n",
			st.Offloaded, st.Onloaded, st.Prefetched, st.Eager, st.PrefetchUseful, st.PrefetchUseless, st.PoolHighWater, st.PoolSlots)
	}
	return nil
}

// medianRound is the row of the round whose overlap% is the median of
// rs (of an even number of rounds, the lower of the middle two; of equal
// ones, the earliest): one whole round, so that its times give its
// overlap% (a median of each field taken separately mixed rounds, and the
// row's times did not give its overlap%).
func medianRound(rs []overlapRow) overlapRow {
	if len(rs) == 0 {
		return overlapRow{}
	}
	idx := make([]int, len(rs))
	for i := range idx {
		idx[i] = i
	}
	sort.SliceStable(idx, func(a, b int) bool { return rs[idx[a]].OverlapPct < rs[idx[b]].OverlapPct })
	return rs[idx[(len(rs)-1)/2]]
}

// compute spins on arithmetic for d without calling the transport and
// returns how long it really ran.
func compute(d time.Duration) time.Duration {
	start := time.Now()
	x := 1.0
	for i := 0; ; i++ {
		x = x*1.0000001 + 1e-9
		if i&255 == 255 && time.Since(start) >= d {
			break
		}
	}
	if x == 0 { // keep x alive
		fmt.Fprint(io.Discard, x)
	}
	return time.Since(start)
}

// Tags of the benchmark's traffic.
const (
	tagOvData = 10
	tagOvCtl  = 11
)

// overlapRank is one rank of an overlap job (--gather-ranks 0) or of a
// gather job (--gather-ranks N, the job's size).
func overlapRank(ctx context.Context, f overlapFlags) error {
	boot, err := bootstrap.FromEnv(ctx)
	if err != nil {
		return err
	}
	defer boot.Close()
	opts := transport.Options{Bootstrap: boot}
	if f.typed && boot.Rank() == 1 {
		// The sender's typed transfers wait inside the transport (for each
		// chunk, for the receiver's answer): let them park at once, as
		// waitQuiet does for byte messages, so that on a machine of few
		// cores the sender leaves the receiver's cores alone.
		opts.WaitSpin = time.Nanosecond
	}
	var eng *overlap.Engine
	if f.engine == "on" {
		if eng, err = overlap.New(overlap.DefaultConfig()); err != nil {
			return err
		}
		opts.Overlap = eng
	}
	t, err := transport.New(ctx, opts)
	if err != nil {
		return err
	}
	defer t.Close()
	var lines []overlapLine
	emit := func(l overlapLine) { lines = append(lines, l) }
	if eng != nil && f.calibrate && t.Rank() < 2 {
		fit, err := t.CalibrateOverlap(ctx, 1-t.Rank(), 16)
		if err != nil {
			// A noisy machine can defeat the fit: keep the defaults.
			fmt.Fprintf(os.Stderr, "rank %d: %v; keeping alpha %.3f ns/B, beta %v\n", t.Rank(), err, eng.Config().Alpha, eng.Config().Beta)
		} else if f.gatherRanks == 0 {
			emit(overlapLine{Extra: &overlapExtra{Bench: "calibration", Engine: f.engine, AlphaNsPerB: fit.Alpha,
				BetaUs: float64(fit.Beta) / 1e3, R2: fit.R2}})
		}
	}
	if f.gatherRanks > 1 {
		if err := gatherBench(ctx, t, f, emit); err != nil {
			return err
		}
	} else {
		if err := overlapBench(ctx, t, f, emit); err != nil {
			return err
		}
		lat, err := perf.Latency(ctx, t, 8, 0.5*f.scale)
		if err != nil {
			return err
		}
		emit(overlapLine{Extra: &overlapExtra{Bench: "latency", Engine: f.engine, Size: 8, LatUs: lat}})
	}
	if st, ok := t.OverlapStats(); ok && f.gatherRanks == 0 {
		emit(overlapLine{Extra: &overlapExtra{Bench: "stats", Engine: f.engine, Stats: &st}})
	}
	if err := writeBenchRows(t.Rank(), lines); err != nil {
		return err
	}
	return boot.Barrier(ctx, "bench.overlap.done")
}

// overlapIters mirrors OSU: fewer iterations for larger messages.
func overlapIters(size int, scale float64) (iters, warmup int) {
	iters, warmup = 200, 10
	if size >= 1<<20 {
		iters = 100
	}
	return max(int(float64(iters)*scale), 5), warmup
}

// overlapBench measures both modes for every size; rank 0 receives (and
// computes), rank 1 sends.
func overlapBench(ctx context.Context, t *transport.Transport, f overlapFlags, emit func(overlapLine)) error {
	if t.Rank() > 1 || f.latencyOnly {
		return nil
	}
	for _, mode := range []string{"expected", "unexpected"} {
		for size := f.minSize; size <= f.maxSize; size *= 2 {
			iters, warmup := overlapIters(size, f.scale)
			m, err := newOvMessage(size, f.typed)
			if err != nil {
				return err
			}
			// Pure communication time: the same iteration without compute.
			comm, _, send, err := overlapLoop(ctx, t, mode, m, iters, warmup, 0, 0)
			if err != nil {
				return err
			}
			// The unexpected mode's receiver is late by twice the transfer
			// time (plus a margin): the message is there when it posts.
			late := 2*comm + 50*time.Microsecond
			if mode == "expected" {
				late = 0
			}
			if mode == "unexpected" {
				if comm, _, send, err = overlapLoop(ctx, t, mode, m, iters, warmup, 0, late); err != nil {
					return err
				}
			}
			total, comp, send2, err := overlapLoop(ctx, t, mode, m, iters, warmup, comm, late)
			if err != nil {
				return err
			}
			_ = send
			if t.Rank() != 0 {
				continue
			}
			pct := 100 * (1 - float64(total-comp)/float64(comm))
			pct = math.Max(pct, 0)
			emit(overlapLine{Row: &overlapRow{Size: size, Mode: mode, Engine: f.engine, OverlapPct: math.Round(pct*10) / 10,
				TCommUs: us(comm), TComputeUs: us(comp), TTotalUs: us(total), SenderUs: us(send2)}})
		}
	}
	return nil
}

func us(d time.Duration) float64 { return math.Round(float64(d)/100) / 10 }

// overlapLoop runs iters timed iterations (after warmup) and returns, on
// rank 0, the median time from posting the receive to its completion, the
// median compute time inside it, and the sender's mean send time (sent back
// by rank 1). Each iteration: rank 0 tells rank 1 to go; in expected mode it
// posts its receive first; rank 1 sends; rank 0 computes late (unexpected
// mode: before posting), then computes work after posting and waits.
func overlapLoop(ctx context.Context, t *transport.Transport, mode string, m ovMessage, iters, warmup int, work, late time.Duration) (total, comp, send time.Duration, err error) {
	ctl := make([]byte, 8)
	peer := 1 - t.Rank()
	var sendSum time.Duration
	var totals, comps []time.Duration
	for i := 0; i < warmup+iters; i++ {
		if t.Rank() == 1 {
			if err := recvQuiet(ctx, t, peer, tagOvCtl, ctl); err != nil {
				return 0, 0, 0, err
			}
			start := time.Now()
			r, err := m.isend(t, peer)
			if err != nil {
				return 0, 0, 0, err
			}
			if err := waitQuiet(ctx, r); err != nil {
				return 0, 0, 0, err
			}
			if i >= warmup {
				sendSum += time.Since(start)
			}
			continue
		}
		var r *transport.Request
		start := time.Now()
		if mode == "expected" {
			if r, err = m.irecv(t, peer); err != nil {
				return 0, 0, 0, err
			}
		}
		if err := t.Send(ctx, peer, tagOvCtl, ctl); err != nil {
			return 0, 0, 0, err
		}
		if mode == "unexpected" {
			compute(late)
			start = time.Now()
			if r, err = m.irecv(t, peer); err != nil {
				return 0, 0, 0, err
			}
		}
		var c time.Duration
		if work > 0 {
			c = compute(work)
		}
		if _, err := r.Wait(ctx); err != nil {
			return 0, 0, 0, err
		}
		if i >= warmup {
			totals = append(totals, time.Since(start))
			comps = append(comps, c)
		}
	}
	// The sender reports its mean send time.
	if t.Rank() == 1 {
		binary.LittleEndian.PutUint64(ctl, uint64(sendSum/time.Duration(iters)))
		return 0, 0, 0, t.Send(ctx, peer, tagOvCtl, ctl)
	}
	if _, err := t.Recv(ctx, peer, tagOvCtl, ctl); err != nil {
		return 0, 0, 0, err
	}
	return medianDur(totals), medianDur(comps), time.Duration(binary.LittleEndian.Uint64(ctl)), nil
}

// ovMessage is the benchmark's data message: size bytes, or with dt set
// one element of dt (size packed bytes) in buf.
type ovMessage struct {
	buf []byte
	dt  *datatype.Type
}

// ovTypedBlock is the block of --typed messages: a vector of such blocks
// at twice their stride packs a multiple of it, so --typed sizes must be
// multiples of it.
const ovTypedBlock = 1 << 10

// newOvMessage returns the data message of size bytes (typed: packed
// bytes of a vector of 1 KiB blocks at a 2 KiB stride; size a multiple of
// 1 KiB).
func newOvMessage(size int, typed bool) (ovMessage, error) {
	if !typed {
		return ovMessage{buf: make([]byte, size)}, nil
	}
	if size <= 0 || size%ovTypedBlock != 0 {
		return ovMessage{}, fmt.Errorf("--typed: a message of %d bytes is not a whole number of %d-byte blocks", size, ovTypedBlock)
	}
	const block = ovTypedBlock
	vec, err := datatype.Vector(int64(size/block), block, 2*block, datatype.Byte)
	if err != nil {
		return ovMessage{}, err
	}
	return ovMessage{buf: make([]byte, vec.Extent()), dt: vec}, nil
}

func (m ovMessage) isend(t *transport.Transport, peer int) (*transport.Request, error) {
	if m.dt != nil {
		return t.IsendTyped(peer, tagOvData, m.buf, m.dt, 1)
	}
	return t.Isend(peer, tagOvData, m.buf)
}

func (m ovMessage) irecv(t *transport.Transport, peer int) (*transport.Request, error) {
	if m.dt != nil {
		return t.IrecvTyped(peer, tagOvData, m.buf, m.dt, 1)
	}
	return t.Irecv(peer, tagOvData, m.buf)
}

// recvQuiet and waitQuiet are how the sender (rank 1) waits: parked on the
// request's channel, without spinning. The benchmark measures overlap on
// the receiving rank; on a cluster the sender runs on other cores. On a
// machine with two cores, a sender spinning in Wait would take the core
// the receiver's progress goroutine needs for the very transfer being
// measured (docs/overlap.md, section 8).
func recvQuiet(ctx context.Context, t *transport.Transport, src, tag int, buf []byte) error {
	r, err := t.Irecv(src, tag, buf)
	if err != nil {
		return err
	}
	return waitQuiet(ctx, r)
}

func waitQuiet(ctx context.Context, r *transport.Request) error {
	select {
	case <-r.Done():
	case <-ctx.Done():
	}
	_, err := r.Wait(ctx)
	return err
}

// medianDur is the median of ds: on a shared machine a few preempted
// iterations would dominate the mean.
// roundRatios returns 100 x on[i] / off[i] for the rounds both measured:
// each round's two jobs ran one after the other, so a slow spell of the
// machine tends to hit both, and the spread of the ratios shows whether
// the medians' difference is more than noise.
func roundRatios(on, off []float64) []float64 {
	var rs []float64
	for i := 0; i < min(len(on), len(off)); i++ {
		if off[i] > 0 {
			rs = append(rs, 100*on[i]/off[i])
		}
	}
	return rs
}

func medianDur(ds []time.Duration) time.Duration {
	xs := make([]float64, len(ds))
	for i, d := range ds {
		xs[i] = float64(d)
	}
	return time.Duration(median(xs))
}

// gatherBench: rank 0 is the late root of a gather; every other rank sends
// it gatherSize bytes. Rank 0 reports the senders' mean time from Isend to
// completion and its own time from releasing the senders to having all data.
func gatherBench(ctx context.Context, t *transport.Transport, f overlapFlags, emit func(overlapLine)) error {
	const iters, warmup = 30, 3
	n := t.Size()
	buf := make([]byte, f.gatherSize)
	ctl := make([]byte, 8)
	var rootSum, sendSum time.Duration
	var recvBufs [][]byte
	if t.Rank() == 0 {
		for i := 1; i < n; i++ {
			recvBufs = append(recvBufs, make([]byte, f.gatherSize))
		}
	}
	for i := 0; i < warmup+iters; i++ {
		if t.Rank() != 0 {
			if _, err := t.Recv(ctx, 0, tagOvCtl, ctl); err != nil {
				return err
			}
			start := time.Now()
			if err := t.Send(ctx, 0, tagOvData, buf); err != nil {
				return err
			}
			if i >= warmup {
				sendSum += time.Since(start)
			}
			continue
		}
		start := time.Now()
		for p := 1; p < n; p++ {
			if err := t.Send(ctx, p, tagOvCtl, ctl); err != nil {
				return err
			}
		}
		compute(f.gatherDelay)
		reqs := make([]*transport.Request, 0, n-1)
		for p := 1; p < n; p++ {
			r, err := t.Irecv(p, tagOvData, recvBufs[p-1])
			if err != nil {
				return err
			}
			reqs = append(reqs, r)
		}
		for _, r := range reqs {
			if _, err := r.Wait(ctx); err != nil {
				return err
			}
		}
		if i >= warmup {
			rootSum += time.Since(start)
		}
	}
	if t.Rank() != 0 {
		binary.LittleEndian.PutUint64(ctl, uint64(sendSum/iters))
		return t.Send(ctx, 0, tagOvCtl, ctl)
	}
	var senders time.Duration
	for p := 1; p < n; p++ {
		if _, err := t.Recv(ctx, p, tagOvCtl, ctl); err != nil {
			return err
		}
		senders += time.Duration(binary.LittleEndian.Uint64(ctl))
	}
	emit(overlapLine{Extra: &overlapExtra{Bench: "gather", Engine: f.engine, Size: f.gatherSize, Ranks: n,
		RootDelayUs: us(f.gatherDelay), SenderUs: us(senders / time.Duration(n-1)), RootUs: us(rootSum / iters)}})
	return nil
}
