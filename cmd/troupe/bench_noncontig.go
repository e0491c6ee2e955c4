package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/datatype/layouts"
	"github.com/troupe-hpc/troupe/transport"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

// ncPoint is one measurement of `troupe bench noncontig --json`.
type ncPoint struct {
	Layout string  `json:"layout"`
	Scheme string  `json:"scheme"`
	LatUs  float64 `json:"lat_us"`
	Bytes  int64   `json:"bytes"`
	Blocks int64   `json:"blocks"`
	// Backend is the gpu backend of --device points (actor benchmark).
	Backend string `json:"backend,omitempty"`
	// Batches is how many batches each scheme ran at this point.
	Batches int `json:"batches"`
	// MedianUs is the median one-way latency of the individual ping-pongs
	// (lat_us with --stat median; typed benchmark only).
	MedianUs float64 `json:"median_us,omitempty"`
	// BestBatchUs is the mean one-way latency of the best batch (lat_us
	// by default; typed benchmark only).
	BestBatchUs float64 `json:"best_batch_us,omitempty"`
	// Used counts, on the adaptive row, the transfers of its timed batches
	// by the scheme they took (rank 0's sends and receives, through actors
	// too): what the adaptive default chose, and how steadily.
	Used *transport.SchemeCounts `json:"used,omitempty"`
}

// addUsed adds to u the transfers by scheme that happened between the
// counters a and b.
func addUsed(u *transport.SchemeCounts, a, b transport.NoncontigStats) {
	u.Pack += b.Sent.Pack - a.Sent.Pack + b.Received.Pack - a.Received.Pack
	u.SGL += b.Sent.SGL - a.Sent.SGL + b.Received.SGL - a.Received.SGL
	u.ZCopy += b.Sent.ZCopy - a.Sent.ZCopy + b.Received.ZCopy - a.Received.ZCopy
}

// usedLabel says which scheme the adaptive transfers took: the name of the
// most frequent one, with its share when others were used too; "-" when
// nothing was counted.
func usedLabel(u *transport.SchemeCounts) string {
	if u == nil {
		return "-"
	}
	n := u.Pack + u.SGL + u.ZCopy
	if n == 0 {
		return "-"
	}
	name, top := "pack", u.Pack
	if u.SGL > top {
		name, top = "sgl", u.SGL
	}
	if u.ZCopy > top {
		name, top = "zcopy", u.ZCopy
	}
	if top == n {
		return name
	}
	return fmt.Sprintf("%s %d%%", name, 100*top/n)
}

// ncSettleGain is the change of a scheme's statistic (best batch or
// median), over ncSettleRounds rounds, below which a point's measurement
// has settled.
const (
	ncSettleGain   = 0.01
	ncSettleRounds = 3
)

// ncSettle decides after each round whether a point's measurement goes on.
// A point runs at least f.rounds rounds; then rounds go on while some
// way's statistic (its best batch, or its median ping-pong) moved by more
// than ncSettleGain in the last ncSettleRounds rounds, up to f.maxRounds
// rounds and while the point has used less than f.budget. On a shared machine the noise only ever adds
// time, and a layout whose batches vary severalfold (nas_mg_x: 0.66 to 4.3
// ms one way in one run, its page walks missing the cache the other
// tenants use) needs more batches than a quiet one before its best is the
// floor. Rank 0 times the batches, decides, and tells rank 1 through the
// bootstrap, so both run the same rounds.
type ncSettle struct {
	boot    bootstrap.Bootstrapper
	key     string
	min     int
	max     int
	end     time.Time
	history [][]float64 // each way's statistic after each round (rank 0)
}

func newNCSettle(boot bootstrap.Bootstrapper, point string, f noncontigFlags) *ncSettle {
	return &ncSettle{boot: boot, key: "nc.settle." + point, min: max(f.rounds, 1),
		max: max(f.maxRounds, f.rounds, 1), end: time.Now().Add(f.budget)}
}

// more reports whether another round follows round (0-based); stats are
// rank 0's statistic per way so far (ignored on other ranks).
func (s *ncSettle) more(ctx context.Context, round int, stats []float64) (bool, error) {
	s.history = append(s.history, stats)
	if round+1 < s.min {
		return true, nil
	}
	decision := []byte{0}
	if s.boot.Rank() == 0 && s.unsettled(round) {
		decision[0] = 1
	}
	all, err := s.boot.AllGather(ctx, s.key, decision)
	if err != nil {
		return false, err
	}
	return len(all[0]) == 1 && all[0][0] == 1, nil
}

// unsettled reports whether rank 0 wants another round after round.
func (s *ncSettle) unsettled(round int) bool {
	if round+1 >= s.max || time.Now().After(s.end) {
		return false
	}
	if len(s.history) <= ncSettleRounds {
		return true // too few rounds to tell
	}
	now, then := s.history[len(s.history)-1], s.history[len(s.history)-1-ncSettleRounds]
	for k := range now {
		if math.Abs(now[k]-then[k]) > then[k]*ncSettleGain {
			return true
		}
	}
	return false
}

type noncontigFlags struct {
	tls       string
	json      bool
	scale     float64
	rounds    int
	maxRounds int
	budget    time.Duration
	layouts   []string
	noVec     bool
	noApp     bool
	actor     bool
	device    bool   // --actor: Go memory against device memory (Typed.Dev)
	stat      string // "median" or "best" (typed benchmark)
	aa        bool   // measure pack a second time (A/A)
	procs     string // GOMAXPROCS of each rank, as troupe run --procs ("": Go's default)
	burst     int    // --actor: messages each side sends before waiting for the other's
	anySource bool   // typed receives name transport.AnySource
}

// ncSchemeOrder is the column order of the table.
var ncSchemeOrder = []datatype.Scheme{datatype.SchemePack, datatype.SchemeSGL, datatype.SchemeZCopy, datatype.SchemeAuto}

// ncAAName is the column of --aa: pack measured a second time, as a fifth
// way taking its turns like the others, so that the ratio of two
// measurements of one scheme shows how finely a run can tell schemes apart.
const ncAAName = "pack2"

// ncTurns is the cycle in which the schemes take turns (indexes into
// ncSchemeOrder). A scheme leaves the machine in a state the next one
// meets: garbage, zero-copy's key-pool refills, caches warmed by packing
// the same layout. With a fixed or rotated order each scheme keeps its
// predecessor: the adaptive default, measured right after zero-copy, paid
// for zero-copy's garbage.
var ncTurns = balancedTurns(len(ncSchemeOrder))

// balancedTurns returns a cycle over 0..n-1 in which, read cyclically,
// every item comes right after every other item exactly once: an Euler
// circuit of the complete directed graph on n vertices (Hierholzer's
// algorithm; every vertex has in-degree = out-degree = n-1, so one exists).
// It has n(n-1) turns, or one turn when n is 1.
func balancedTurns(n int) []int {
	if n < 2 {
		return make([]int, n)
	}
	out := make([][]int, n) // out[v]: the edges v->u not walked yet
	for v := range out {
		for u := 0; u < n; u++ {
			if u != v {
				out[v] = append(out[v], u)
			}
		}
	}
	stack, circuit := []int{0}, make([]int, 0, n*(n-1)+1)
	for len(stack) > 0 {
		v := stack[len(stack)-1]
		if len(out[v]) > 0 {
			stack = append(stack, out[v][0])
			out[v] = out[v][1:]
			continue
		}
		circuit = append(circuit, v)
		stack = stack[:len(stack)-1]
	}
	slices.Reverse(circuit)
	return circuit[:len(circuit)-1] // closed walk: the last vertex is the first
}

// Vector sweep: blocks of 64 B .. 16 KiB, 16 .. 1024 of them, stride twice
// the block.
var (
	ncVecBlocks = []int64{64, 256, 1024, 4096, 16384}
	ncVecCounts = []int64{16, 64, 256, 1024}
)

func newNoncontigCmd() *cobra.Command {
	var f noncontigFlags
	cmd := &cobra.Command{
		Use:   "noncontig",
		Short: "Typed-transfer ping-pong latency per scheme (pack, sgl, zcopy, adaptive) on vectors and DDTBench layouts",
		Long: `noncontig starts a two-rank job through the embedded launcher and measures
OSU-style ping-pong latency (half the round trip) of typed transfers, the same
layout on both sides, for each fixed scheme and for the adaptive default
(after warm-up, so its layouts are cached and registered): a vector sweep
(blocks of 64 B to 16 KiB, 16 to 1024 blocks, stride twice the block; named
vec_<block>x<count>) and the 13 DDTBench layouts. The schemes take turns in
short batches, in an order in which each follows each other equally often,
for --rounds rounds, then for further rounds (up to --max-rounds and
--point-time) while some scheme's statistic still moved by more than 1 % in
the last three rounds. Each scheme's best batch (the mean of its ping-pongs) is
reported; --stat median reports the median of all its ping-pongs instead (each
is timed on its own, and --json gives both). --aa measures pack a second time
as a fifth way (pack2), to show how finely the run tells schemes apart. With
--actor the five ways (am and the four schemes) take turns the same way, and
each way's best batch is reported.`,
		Args: cobra.NoArgs,
	}
	fl := cmd.Flags()
	fl.StringVar(&f.tls, "tls", "shm", "UCX transports: shm, tcp, or a UCX_TLS value")
	fl.StringVar(&f.procs, "procs", "split", `GOMAXPROCS of each rank as in troupe run: "split" (this process's processors halved), a count, or "" for Go's default`)
	fl.BoolVar(&f.json, "json", false, `print one JSON object per point: {"layout":"vec_4096x64","scheme":"pack|sgl|zcopy|adaptive","lat_us":...}`)
	fl.Float64Var(&f.scale, "scale", 1, "iteration count multiplier (positive, finite)")
	fl.IntVar(&f.rounds, "rounds", 4, "rounds per point at least; in each the schemes take turns in batches, each scheme 3 batches (4 with --aa)")
	fl.IntVar(&f.maxRounds, "max-rounds", 16, "rounds per point at most: after --rounds, rounds go on while a scheme's statistic still moves by more than 1% in three rounds")
	fl.StringVar(&f.stat, "stat", "best", "what is reported per scheme: best (batch) or median (of the individual ping-pongs)")
	fl.BoolVar(&f.aa, "aa", false, "measure pack a second time (column pack2) as a check of the run's resolution")
	fl.DurationVar(&f.budget, "point-time", 20*time.Second, "no further round of a point starts after this much time on it")
	fl.StringSliceVar(&f.layouts, "layout", nil, "only these layouts (vec_<block>x<count> or DDTBench names; not empty)")
	fl.BoolVar(&f.noVec, "no-vectors", false, "skip the vector sweep")
	fl.BoolVar(&f.anySource, "any-source", false, "receive every typed message with transport.AnySource (not with --actor)")
	fl.BoolVar(&f.noApp, "no-apps", false, "skip the DDTBench layouts")
	fl.BoolVar(&f.actor, "actor", false, "ping-pong actor messages with a Typed field instead: packed into the active message (am) or by the typed-transfer protocol per scheme")
	fl.BoolVar(&f.device, "device", false, "with --actor: ping-pong both paths (am, adaptive) with the layouts in Go memory and in device memory (Typed.Dev; gpu backend as TROUPE_GPU chooses), columns dev-am and dev-adaptive")
	fl.IntVar(&f.burst, "burst", 1, "with --actor: each side sends this many messages in a row, then waits for as many from the other (latency per message, one way)")
	setBenchRun(cmd, func(ctx context.Context) error { return noncontigRank(ctx, f) },
		func(ctx context.Context, out io.Writer) error {
			if f.stat != "median" && f.stat != "best" {
				return fmt.Errorf("--stat %q: want median or best", f.stat)
			}
			if f.actor && (f.aa || f.stat != "best") {
				return fmt.Errorf("--aa and --stat median measure typed transfers, not --actor")
			}
			if f.device && !f.actor {
				return fmt.Errorf("--device measures actor Typed fields: give --actor too")
			}
			if f.actor && f.anySource {
				return fmt.Errorf("--any-source measures typed receives, not --actor")
			}
			if f.burst < 1 || (f.burst > 1 && !f.actor) {
				return fmt.Errorf("--burst %d: a count of at least 1, above 1 only with --actor", f.burst)
			}
			if err := checkCounts("--scale", f.scale, "--rounds", f.rounds, "--max-rounds", f.maxRounds, "--point-time", f.budget); err != nil {
				return err
			}
			// --layout "" leaves the list empty, which means all layouts.
			if cmd.Flags().Changed("layout") && len(f.layouts) == 0 {
				return fmt.Errorf("--layout: an empty layout name")
			}
			// Refuse an unknown or excluded layout before the job starts.
			if _, err := noncontigCases(f); err != nil {
				return err
			}
			pts, err := runNoncontigJob(ctx, f)
			if err != nil {
				return err
			}
			return printNoncontig(out, f, pts)
		})
	return cmd
}

func init() { benchCmd.AddCommand(newNoncontigCmd()) }

// ncCase is one layout of the benchmark.
type ncCase struct {
	name  string
	dt    *datatype.Type
	alloc int64
	base  int64
}

func noncontigCases(f noncontigFlags) ([]ncCase, error) {
	want := map[string]bool{}
	for _, n := range f.layouts {
		want[n] = true
	}
	found := map[string]bool{}
	keep := func(n string) bool {
		found[n] = true
		return len(want) == 0 || want[n]
	}
	var cs []ncCase
	if !f.noVec {
		for _, b := range ncVecBlocks {
			for _, n := range ncVecCounts {
				name := fmt.Sprintf("vec_%dx%d", b, n)
				if !keep(name) {
					continue
				}
				c, err := ncVector(b, n)
				if err != nil {
					return nil, err
				}
				cs = append(cs, c)
			}
		}
	}
	if !f.noApp {
		for _, name := range layouts.Names {
			if !keep(name) {
				continue
			}
			l, err := layouts.Build(name)
			if err != nil {
				return nil, err
			}
			cs = append(cs, ncCase{name, l.Type, l.Alloc, l.Base})
		}
	}
	// A named vector outside the sweep is measured too; any other unknown
	// name is an error rather than silently measuring nothing for it.
	for _, name := range f.layouts {
		if found[name] {
			continue
		}
		if name == "" {
			return nil, fmt.Errorf("--layout: an empty layout name")
		}
		if slices.Contains(layouts.Names, name) { // only --no-apps skips one
			return nil, fmt.Errorf("layout %q is a DDTBench layout, which --no-apps leaves out", name)
		}
		var b, n int64
		if _, err := fmt.Sscanf(name, "vec_%dx%d", &b, &n); err != nil || name != fmt.Sprintf("vec_%dx%d", b, n) {
			return nil, fmt.Errorf("unknown layout %q: vec_<block>x<count> (block bytes a multiple of 8) or one of %s", name, strings.Join(layouts.Names, ", "))
		}
		if f.noVec {
			return nil, fmt.Errorf("layout %q is a vector, which --no-vectors leaves out", name)
		}
		c, err := ncVector(b, n)
		if err != nil {
			return nil, fmt.Errorf("layout %q: %w", name, err)
		}
		cs = append(cs, c)
	}
	if len(cs) == 0 {
		return nil, fmt.Errorf("no layout selected")
	}
	return cs, nil
}

// ncVector is the sweep's vector layout: count blocks of block bytes
// (float64 elements), each block followed by a gap of its size.
func ncVector(block, count int64) (ncCase, error) {
	if block <= 0 || block%8 != 0 {
		return ncCase{}, fmt.Errorf("vector block of %d bytes: a positive multiple of 8 is needed", block)
	}
	if count < 1 {
		return ncCase{}, fmt.Errorf("vector of %d blocks: at least 1 is needed (an empty layout measures nothing)", count)
	}
	if block > maxBenchSize || count > maxBenchSize/block/2 {
		return ncCase{}, fmt.Errorf("vector of %d blocks of %d bytes: its buffer would pass %d bytes", count, block, maxBenchSize)
	}
	v, err := datatype.Vector(count, block/8, 2*block/8, datatype.Float64)
	if err != nil {
		return ncCase{}, err
	}
	return ncCase{fmt.Sprintf("vec_%dx%d", block, count), v, v.Extent(), 0}, nil
}

// ncRun is one case made ready to measure: its buffer filled with the
// layouts pattern, its packed size and segment count, and its iterations.
type ncRun struct {
	buf             []byte
	bytes, segments int64
	iters, warmup   int
}

func (c ncCase) prepare(scale float64) (ncRun, error) {
	r := ncRun{buf: make([]byte, c.alloc)}
	layouts.Fill(r.buf, c.base)
	var err error
	if r.bytes, err = c.dt.PackedSize(1); err != nil {
		return r, err
	}
	lay, err := datatype.Flatten(c.dt, 0, 1)
	if err != nil {
		return r, err
	}
	r.segments = lay.Stats.Segments
	r.iters, r.warmup = ncIters(r.bytes, r.segments, scale)
	return r, nil
}

func runNoncontigJob(ctx context.Context, f noncontigFlags) ([]ncPoint, error) {
	args := []string{"bench", "noncontig", "--as-rank", "--scale", strconv.FormatFloat(f.scale, 'g', -1, 64),
		"--rounds", strconv.Itoa(f.rounds), "--max-rounds", strconv.Itoa(f.maxRounds), "--point-time", f.budget.String(),
		"--stat", f.stat}
	if f.aa {
		args = append(args, "--aa")
	}
	if len(f.layouts) > 0 {
		args = append(args, "--layout", strings.Join(f.layouts, ","))
	}
	if f.noVec {
		args = append(args, "--no-vectors")
	}
	if f.noApp {
		args = append(args, "--no-apps")
	}
	if f.actor {
		args = append(args, "--actor", "--burst", strconv.Itoa(f.burst))
	}
	if f.device {
		args = append(args, "--device")
	}
	if f.anySource {
		args = append(args, "--any-source")
	}
	procs, err := parseProcs(f.procs)
	if err != nil {
		return nil, fmt.Errorf("bench noncontig: %w", err)
	}
	return runBenchJob[ncPoint](ctx, 2, f.tls, procs, args, nil)
}

// ncIters picks the ping-pongs per scheme of one round from the size and
// block count (a zero-copy or SGL transfer of 65536 tiny blocks takes
// hundreds of milliseconds).
func ncIters(bytes, blocks int64, scale float64) (iters, warmup int) {
	n := min(max(32<<20/max(bytes, 1), 10), 250, max(100000/max(blocks, 1), 3))
	return max(int(float64(n)*scale), 3), 5
}

func noncontigRank(ctx context.Context, f noncontigFlags) error {
	boot, err := bootstrap.FromEnv(ctx)
	if err != nil {
		return err
	}
	defer boot.Close()
	t, err := transport.New(ctx, transport.Options{Bootstrap: boot})
	if err != nil {
		return err
	}
	defer t.Close()
	cases, err := noncontigCases(f)
	if err != nil {
		return err
	}
	if f.actor {
		return noncontigActorRank(ctx, f, boot, t, cases)
	}
	enc, closeOut, err := benchOut(t.Rank())
	if err != nil {
		return err
	}
	defer closeOut()
	peer, from := 1-t.Rank(), 1-t.Rank()
	if f.anySource {
		from = transport.AnySource
	}
	schemes, names := slices.Clone(ncSchemeOrder), make([]string, 0, len(ncSchemeOrder)+1)
	for _, s := range schemes {
		names = append(names, s.String())
	}
	turns := ncTurns
	if f.aa {
		schemes, names = append(schemes, datatype.SchemePack), append(names, ncAAName)
		turns = balancedTurns(len(schemes))
	}
	for ci, c := range cases {
		r, err := c.prepare(f.scale)
		if err != nil {
			return err
		}
		buf, bytes, iters, warmup := r.buf, r.bytes, r.iters, r.warmup
		one := func(s datatype.Scheme) error {
			o := transport.TypedOptions{Scheme: s, Base: int(c.base)}
			tag := ci % (transport.MaxUserTag + 1)
			if t.Rank() == 0 {
				if err := t.SendTypedWith(ctx, peer, tag, buf, c.dt, 1, o); err != nil {
					return err
				}
				_, err := t.RecvTypedWith(ctx, from, tag, buf, c.dt, 1, o)
				return err
			}
			if _, err := t.RecvTypedWith(ctx, from, tag, buf, c.dt, 1, o); err != nil {
				return err
			}
			return t.SendTypedWith(ctx, peer, tag, buf, c.dt, 1, o)
		}
		// The schemes take turns batch by batch (ncTurns), so that a
		// slow spell of the shared machine hits them alike. Each batch
		// starts from a collected heap and with a few untimed ping-pongs,
		// which bring back what the previous scheme took from the caches.
		// The machine's noise only ever adds time, so each scheme's best
		// batch is reported by default. Every ping-pong is also timed on
		// its own, for --stat median (docs/noncontig.md, "How finely a
		// run tells schemes apart").
		batch := max(iters/4, 3)
		m := newNCMeasure(len(schemes), f.stat)
		settle := newNCSettle(boot, c.name, f)
		var used transport.SchemeCounts // the adaptive batches' schemes
		for round := 0; ; round++ {
			for _, k := range turns {
				s := schemes[k]
				runtime.GC()
				for i := 0; i < warmup; i++ {
					if err := one(s); err != nil {
						return fmt.Errorf("%s %v warm-up: %w", c.name, s, err)
					}
				}
				before := t.NoncontigStats()
				m.startBatch()
				for i := 0; i < batch; i++ {
					start := time.Now()
					if err := one(s); err != nil {
						return fmt.Errorf("%s %v: %w", c.name, s, err)
					}
					m.add(k, time.Since(start))
				}
				m.endBatch(k)
				if s == datatype.SchemeAuto {
					addUsed(&used, before, t.NoncontigStats())
				}
			}
			if more, err := settle.more(ctx, round, m.stats()); err != nil || !more {
				if err != nil {
					return err
				}
				break
			}
		}
		if enc != nil {
			for k, name := range names {
				p := ncPoint{Layout: c.name, Scheme: name, LatUs: m.stat(k), Bytes: bytes, Blocks: r.segments,
					Batches: len(m.batches[k]), MedianUs: m.median(k), BestBatchUs: m.bestBatch(k)}
				if schemes[k] == datatype.SchemeAuto {
					p.Used = &used
				}
				if err := enc.Encode(p); err != nil {
					return err
				}
			}
		}
		fmt.Fprintf(os.Stderr, "rank %d: %s done\n", t.Rank(), c.name)
	}
	if t.Rank() == 0 {
		st := t.NoncontigStats()
		fmt.Fprintf(os.Stderr, "rank 0 counters: %+v\n", st)
	}
	return boot.Barrier(ctx, "bench.noncontig.done")
}

// ncMeasure collects one point's timings per way: every ping-pong's
// one-way latency and each batch's mean, in microseconds.
type ncMeasure struct {
	best     bool        // the statistic is the best batch, not the median
	pingpong [][]float64 // per way: one-way latency of each ping-pong
	batches  [][]float64 // per way: mean one-way latency of each batch
	batch    float64     // sum over the batch in progress
	n        int         // ping-pongs in the batch in progress
}

func newNCMeasure(ways int, stat string) *ncMeasure {
	return &ncMeasure{best: stat == "best", pingpong: make([][]float64, ways), batches: make([][]float64, ways)}
}

func (m *ncMeasure) startBatch() { m.batch, m.n = 0, 0 }

// add records one ping-pong (a round trip) of way k.
func (m *ncMeasure) add(k int, rtt time.Duration) {
	us := float64(rtt.Nanoseconds()) / 2e3
	m.pingpong[k] = append(m.pingpong[k], us)
	m.batch += us
	m.n++
}

func (m *ncMeasure) endBatch(k int) {
	if m.n > 0 {
		m.batches[k] = append(m.batches[k], m.batch/float64(m.n))
	}
}

// median is way k's median ping-pong (the mean of the middle two for an
// even count).
func (m *ncMeasure) median(k int) float64 {
	v := slices.Clone(m.pingpong[k])
	if len(v) == 0 {
		return 0
	}
	slices.Sort(v)
	h := len(v) / 2
	if len(v)%2 == 1 {
		return v[h]
	}
	return (v[h-1] + v[h]) / 2
}

// bestBatch is way k's best batch mean (0 before any batch).
func (m *ncMeasure) bestBatch(k int) float64 {
	if len(m.batches[k]) == 0 {
		return 0
	}
	return slices.Min(m.batches[k])
}

// stat is way k's reported latency.
func (m *ncMeasure) stat(k int) float64 {
	if m.best {
		return m.bestBatch(k)
	}
	return m.median(k)
}

// stats is every way's stat so far.
func (m *ncMeasure) stats() []float64 {
	out := make([]float64, len(m.pingpong))
	for k := range out {
		out[k] = m.stat(k)
	}
	return out
}

// ncRow is one layout's line of the table: its latency per column.
type ncRow struct {
	layout        string
	bytes, blocks int64
	batches       int
	lat           map[string]float64
	used          *transport.SchemeCounts
}

func printNoncontig(out io.Writer, f noncontigFlags, pts []ncPoint) error {
	if f.json {
		enc := json.NewEncoder(out)
		for _, p := range pts {
			if err := enc.Encode(p); err != nil {
				return err
			}
		}
		return nil
	}
	var rows []*ncRow
	idx := map[string]*ncRow{}
	for _, p := range pts {
		r := idx[p.Layout]
		if r == nil {
			r = &ncRow{layout: p.Layout, bytes: p.Bytes, blocks: p.Blocks, batches: p.Batches, lat: map[string]float64{}}
			idx[p.Layout] = r
			rows = append(rows, r)
		}
		r.lat[p.Scheme] = p.LatUs
		if p.Scheme == "adaptive" {
			r.used = p.Used
		}
	}
	what, cols := "typed", []string{"pack", "sgl", "zcopy", "adaptive"}
	if f.anySource {
		what = "typed (any-source receives)"
	}
	how := "best of each scheme's interleaved batches (batches: how many each)"
	if f.stat == "median" {
		how = "median of each scheme's ping-pongs, taken in interleaved batches (batches: how many each)"
	}
	if f.actor {
		what, cols = "actor Typed-field", []string{"am", "pack", "sgl", "zcopy", "adaptive"}
		if f.burst > 1 {
			what = fmt.Sprintf("actor Typed-field bursts of %d,", f.burst)
		}
	}
	if f.device {
		backend := "?"
		if len(pts) > 0 {
			backend = pts[0].Backend
		}
		return printNoncontigDevice(out, f, backend, rows)
	}
	fixed := len(cols) - 1 // the fixed schemes are the columns before adaptive
	if f.aa {
		cols = append(cols, ncAAName)
	}
	fmt.Fprintf(out, "# %s ping-pong latency (us, one way), 2 ranks (GOMAXPROCS %s), UCX_TLS=%s, %s\n", what, procsLabel(f.procs, 2), bootstrap.UCXTLS(f.tls), how)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "layout\tbytes\tblocks\tbatches\t%s\tbest fixed\tadaptive/best\tadaptive used\t", strings.Join(cols, "\t"))
	if f.aa {
		fmt.Fprint(tw, "pack2/pack\t")
	}
	fmt.Fprintln(tw)
	within, aaWithin := 0, 0
	for _, r := range rows {
		bestName, bestLat := "", 0.0
		for _, s := range cols[:fixed] {
			if l, ok := r.lat[s]; ok && (bestName == "" || l < bestLat) {
				bestName, bestLat = s, l
			}
		}
		ratio := r.lat["adaptive"] / bestLat
		if ratio <= 1.05 {
			within++
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t", r.layout, r.bytes, r.blocks, r.batches)
		for _, s := range cols {
			fmt.Fprintf(tw, "%.1f\t", r.lat[s])
		}
		fmt.Fprintf(tw, "%s\t%.2f\t%s\t", bestName, ratio, usedLabel(r.used))
		if f.aa {
			q := r.lat[ncAAName] / r.lat["pack"]
			if q >= 1/1.05 && q <= 1.05 {
				aaWithin++
			}
			fmt.Fprintf(tw, "%.2f\t", q)
		}
		fmt.Fprintln(tw)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(out, "# adaptive within 5%% of the best fixed scheme at %d of %d points\n", within, len(rows))
	if f.aa {
		fmt.Fprintf(out, "# pack measured twice (A/A) within 5%% of itself at %d of %d points\n", aaWithin, len(rows))
	}
	return nil
}

// printNoncontigDevice prints the table of --actor --device: each path's
// latency with Go memory and with device memory, and their ratios.
func printNoncontigDevice(out io.Writer, f noncontigFlags, backend string, rows []*ncRow) error {
	fmt.Fprintf(out, "# actor Typed-field ping-pong latency (us, one way), Go memory against device memory (gpu backend %s), 2 ranks (GOMAXPROCS %s), UCX_TLS=%s, best of each way's interleaved batches (batches: how many each)\n",
		backend, procsLabel(f.procs, 2), bootstrap.UCXTLS(f.tls))
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "layout\tbytes\tblocks\tbatches\tam\tadaptive\tdev-am\tdev-adaptive\tdev-am/am\tdev-adaptive/adaptive\t")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%.1f\t%.1f\t%.1f\t%.1f\t%.2f\t%.2f\t\n", r.layout, r.bytes, r.blocks, r.batches,
			r.lat["am"], r.lat["adaptive"], r.lat["dev-am"], r.lat["dev-adaptive"],
			r.lat["dev-am"]/r.lat["am"], r.lat["dev-adaptive"]/r.lat["adaptive"])
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(out, "# dev-*: both ranks' layouts in device memory (actor.Typed.Dev), packed into and unpacked from pinned staging memory")
	return nil
}
