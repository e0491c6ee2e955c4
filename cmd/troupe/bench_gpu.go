package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/troupe-hpc/troupe/actor"
	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
	"github.com/troupe-hpc/troupe/transport/perf"
)

// gpuPoint is one measurement of troupe bench gpu.
type gpuPoint struct {
	API     string  `json:"api"`     // messaging, channel or staged
	Backend string  `json:"backend"` // host or cuda
	Size    int     `json:"size"`
	LatUs   float64 `json:"lat_us"`
	BwMBps  float64 `json:"bw_MBps"`
}

type gpuBenchFlags struct {
	tls     string
	backend string
	json    bool
	minSize int
	maxSize int
	scale   float64
	window  int
	stat    string // latency statistic: "mean" (OSU's) or "median"
}

func newGPUBenchCmd() *cobra.Command {
	var f gpuBenchFlags
	cmd := &cobra.Command{
		Use:   "gpu",
		Short: "Device-buffer latency and bandwidth: channels vs hand-written host staging, OSU style",
		Long: `gpu starts a two-rank job and measures, for device buffers on the selected
gpu backend, one-way latency (half a ping-pong) and bandwidth (a window of
messages, then a 1-byte acknowledgement) through the Channel API and through
explicit host staging written by hand (stream copy into pinned memory,
synchronize, tagged send; receive into pinned memory, copy to the device,
synchronize), and through the GPU Messaging API (actor messages with a
gpu.Buffer field, landing where the receiver's PostReceiveDevice hook
says; latency is half an echoed round trip, bandwidth a window of messages
acknowledged by one actor message). --stat median reports the median round
trip's half instead of the mean's: on a shared machine a few round trips
that wait for the scheduler can move the mean by several times. Sizes:
--min, then steps of x4, and --max as the last point.`,
		Args: cobra.NoArgs,
	}
	fl := cmd.Flags()
	fl.StringVar(&f.tls, "tls", "shm", "UCX transports: shm, tcp, or a UCX_TLS value")
	fl.StringVar(&f.backend, "backend", "auto", "gpu backend of the ranks: auto, host or cuda (TROUPE_GPU)")
	fl.BoolVar(&f.json, "json", false, `print one JSON object per point: {"api":"messaging|channel|staged","backend":"host|cuda","size":...,"lat_us":...,"bw_MBps":...}`)
	fl.IntVar(&f.minSize, "min", 8, "smallest message size in bytes")
	fl.IntVar(&f.maxSize, "max", 4<<20, "largest message size in bytes")
	fl.Float64Var(&f.scale, "scale", 1, "iteration count multiplier (positive, finite)")
	fl.IntVar(&f.window, "window", 16, "messages in flight for bandwidth (at most 4096; --window x --max at most 1 GiB: each rank allocates that much device memory and as much pinned memory)")
	fl.StringVar(&f.stat, "stat", "mean", "latency statistic: mean (of the round trips, as OSU) or median")
	setBenchRun(cmd, func(ctx context.Context) error { return gpuBenchRank(ctx, f) },
		func(ctx context.Context, out io.Writer) error {
			if f.stat != "mean" && f.stat != "median" {
				return fmt.Errorf("--stat %q: want mean or median", f.stat)
			}
			if err := checkSizes(f.minSize, f.maxSize); err != nil {
				return err
			}
			if err := checkCounts("--scale", f.scale, "--window", f.window); err != nil {
				return err
			}
			if err := checkGPUWindow(f.window, f.maxSize); err != nil {
				return err
			}
			pts, err := runGPUBenchJob(ctx, f)
			if err != nil {
				return err
			}
			return printGPUPoints(out, f, pts)
		})
	return cmd
}

func init() { benchCmd.AddCommand(newGPUBenchCmd()) }

// maxGPUWindow bounds --window of bench gpu: each rank allocates a device
// buffer and a pinned buffer per message of the window.
const maxGPUWindow = 4096

// checkGPUWindow refuses a window a rank cannot allocate: more than
// maxGPUWindow buffers, or window buffers of maxSize bytes that take more
// than maxBenchSize bytes together (as many again are pinned host memory).
func checkGPUWindow(window, maxSize int) error {
	if window > maxGPUWindow {
		return fmt.Errorf("--window %d: want at most %d (each rank allocates a device and a pinned buffer per message of the window)", window, maxGPUWindow)
	}
	if window*maxSize > maxBenchSize {
		return fmt.Errorf("--window %d of --max %d: %d bytes of device buffers per rank (and as many pinned), want at most %d: lower --window or --max", window, maxSize, window*maxSize, maxBenchSize)
	}
	return nil
}

func printGPUPoints(out io.Writer, f gpuBenchFlags, pts []gpuPoint) error {
	if f.json {
		enc := json.NewEncoder(out)
		for _, p := range pts {
			if err := enc.Encode(p); err != nil {
				return err
			}
		}
		return nil
	}
	backend := "?"
	if len(pts) > 0 {
		backend = pts[0].Backend
	}
	type row struct{ msg, ch, st *gpuPoint }
	rows := map[int]*row{}
	var sizes []int
	for i := range pts {
		p := &pts[i]
		r := rows[p.Size]
		if r == nil {
			r = &row{}
			rows[p.Size] = r
			sizes = append(sizes, p.Size)
		}
		switch p.API {
		case "messaging":
			r.msg = p
		case "channel":
			r.ch = p
		default:
			r.st = p
		}
	}
	fmt.Fprintf(out, "# troupe bench gpu: device buffers, 2 ranks, gpu backend %s, UCX_TLS=%s, window %d, latency: %s round trip / 2\n", backend, bootstrap.UCXTLS(f.tls), f.window, f.stat)
	fmt.Fprintf(out, "%-8s %12s %12s %12s %14s %14s %14s\n", "# size", "msg lat(us)", "chan lat(us)", "stag lat(us)", "msg bw(MB/s)", "chan bw(MB/s)", "stag bw(MB/s)")
	for _, s := range sizes {
		r := rows[s]
		val := func(p *gpuPoint, lat bool) string {
			if p == nil {
				return "-"
			}
			if lat {
				return strconv.FormatFloat(p.LatUs, 'f', 2, 64)
			}
			return strconv.FormatFloat(p.BwMBps, 'f', 1, 64)
		}
		fmt.Fprintf(out, "%-8s %12s %12s %12s %14s %14s %14s\n", perf.FormatSize(s), val(r.msg, true), val(r.ch, true), val(r.st, true), val(r.msg, false), val(r.ch, false), val(r.st, false))
	}
	fmt.Fprintln(out, "# msg = GPU Messaging API (actor messages with a gpu.Buffer field, by CUDA IPC between processes of a host on cuda, else staged through host memory), chan = Channel API, stag = host staging by hand")
	return nil
}

func runGPUBenchJob(ctx context.Context, f gpuBenchFlags) ([]gpuPoint, error) {
	return runBenchJob[gpuPoint](ctx, 2, f.tls, 0, []string{"bench", "gpu", "--as-rank",
		"--min", strconv.Itoa(f.minSize), "--max", strconv.Itoa(f.maxSize),
		"--scale", strconv.FormatFloat(f.scale, 'g', -1, 64), "--window", strconv.Itoa(f.window), "--stat", f.stat},
		[]string{gpu.EnvBackend + "=" + f.backend})
}

// gpuBenchRank is one rank of the benchmark job.
func gpuBenchRank(ctx context.Context, f gpuBenchFlags) error {
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
	sys, err := gpu.Open()
	if err != nil {
		return err
	}
	defer sys.Close()
	enc, closeOut, err := benchOut(t.Rank())
	if err != nil {
		return err
	}
	defer closeOut()
	stopTrace, err := benchTrace(t.Rank())
	if err != nil {
		return err
	}
	defer stopTrace()
	b, err := newGPUBench(t, sys, f)
	if err != nil {
		return err
	}
	defer b.close()
	if err := b.startMessaging(ctx); err != nil {
		return err
	}
	defer shutdownRank(b.rt)
	if err := boot.Barrier(ctx, "bench.gpu.actors"); err != nil {
		return err
	}
	for _, size := range gpuSizes(f.minSize, f.maxSize) {
		for _, api := range []string{"messaging", "channel", "staged"} {
			if err := boot.Barrier(ctx, fmt.Sprintf("bench.gpu.%s.%d", api, size)); err != nil {
				return err
			}
			var lat, bw float64
			if api == "messaging" {
				lat, bw, err = b.measureMessaging(ctx, size)
			} else {
				lat, bw, err = b.measure(ctx, api, size)
			}
			if err != nil {
				return fmt.Errorf("%s %d B: %w", api, size, err)
			}
			if enc != nil && (api != "messaging" || size > 0) {
				if err := enc.Encode(gpuPoint{API: api, Backend: sys.Backend(), Size: size, LatUs: lat, BwMBps: bw}); err != nil {
					return err
				}
			}
		}
	}
	return boot.Barrier(ctx, "bench.gpu.done")
}

// gpuSizes lists the benchmark's sizes: minSize, then x4 steps up to
// maxSize, and maxSize itself when the steps skip it (checkSizes keeps
// minSize at least 1; a size below 1 steps to 1).
func gpuSizes(minSize, maxSize int) []int {
	var s []int
	for size := minSize; size <= maxSize; size = max(size*4, 1) {
		s = append(s, size)
		if size > maxSize/4 {
			break // the next step passes maxSize (or would overflow)
		}
	}
	if len(s) > 0 && s[len(s)-1] != maxSize {
		s = append(s, maxSize)
	}
	return s
}

// gpuBench holds the buffers of one rank: a window of device buffers and, for
// hand staging, as many pinned buffers.
type gpuBench struct {
	t      *transport.Transport
	sys    *gpu.System
	f      gpuBenchFlags
	peer   int
	ch     *transport.Channel
	stream *gpu.Stream
	rt     *actor.Runtime // the Messaging API column
	msg    *gpuMsgActor
	dev    []gpu.Buffer
	pin    []gpu.Buffer
	ack    []byte
}

func newGPUBench(t *transport.Transport, sys *gpu.System, f gpuBenchFlags) (*gpuBench, error) {
	b := &gpuBench{t: t, sys: sys, f: f, peer: 1 - t.Rank(), ack: make([]byte, 1)}
	var err error
	if b.ch, err = t.Channel(1, b.peer); err != nil {
		return nil, err
	}
	if b.stream, err = sys.Devices()[0].NewStream(); err != nil {
		return nil, err
	}
	for i := 0; i < max(f.window, 1); i++ {
		d, err := sys.Devices()[0].Alloc(max(f.maxSize, 1))
		if err != nil {
			return nil, err
		}
		if err := gpu.Memset(d, byte(i)); err != nil {
			return nil, err
		}
		p, err := sys.AllocHost(max(f.maxSize, 1))
		if err != nil {
			return nil, err
		}
		b.dev, b.pin = append(b.dev, d), append(b.pin, p)
	}
	return b, nil
}

func (b *gpuBench) close() {
	_ = b.ch.Close()
	_ = b.stream.Destroy()
	for i := range b.dev {
		_ = gpu.Free(b.dev[i])
		_ = gpu.Free(b.pin[i])
	}
}

// iterations scales the repetitions with the size: about 32 MiB per latency
// point (10..2000 round trips) and 64 MiB per bandwidth point.
func (b *gpuBench) iterations(size int) (lat, bw int) {
	lat = int(b.f.scale * float64(min(2000, max(10, (32<<20)/max(size, 1)))))
	bw = int(b.f.scale * float64(min(200, max(4, (64<<20)/(max(size, 1)*b.f.window)))))
	return max(lat, 2), max(bw, 2)
}

func (b *gpuBench) measure(ctx context.Context, api string, size int) (latUs, bwMBps float64, err error) {
	lat, bw := b.iterations(size)
	warm := max(lat/10, 2)
	if _, err := b.pingpong(ctx, api, size, warm); err != nil {
		return 0, 0, err
	}
	rts, err := b.pingpong(ctx, api, size, lat)
	if err != nil {
		return 0, 0, err
	}
	latUs = oneWayUs(rts, b.f.stat)
	if _, err := b.stream1(ctx, api, size, 1); err != nil {
		return 0, 0, err
	}
	d, err := b.stream1(ctx, api, size, bw)
	if err != nil {
		return 0, 0, err
	}
	bwMBps = float64(size) * float64(bw*b.f.window) / d.Seconds() / 1e6
	return latUs, bwMBps, nil
}

// send and recv move one message of size bytes from/into window slot i.
func (b *gpuBench) send(ctx context.Context, api string, i, size int) error {
	src, err := b.dev[i].Slice(0, size)
	if err != nil {
		return err
	}
	if api == "channel" {
		r, err := b.ch.Send(src)
		if err != nil {
			return err
		}
		return r.Wait(ctx)
	}
	r, err := b.isendStaged(i, src)
	if err != nil {
		return err
	}
	_, err = r.Wait(ctx)
	return err
}

// isendStaged is hand-written staging: device -> pinned on the stream,
// synchronize, then a tagged send of the pinned bytes.
func (b *gpuBench) isendStaged(i int, src gpu.Buffer) (*transport.Request, error) {
	p, err := b.pin[i].Slice(0, src.Len())
	if err != nil {
		return nil, err
	}
	if err := gpu.CopyAsync(b.stream, p, src); err != nil {
		return nil, err
	}
	if err := b.stream.Synchronize(); err != nil {
		return nil, err
	}
	pb, err := p.Bytes()
	if err != nil {
		return nil, err
	}
	return b.t.Isend(b.peer, 1, pb)
}

func (b *gpuBench) recv(ctx context.Context, api string, i, size int) error {
	dst, err := b.dev[i].Slice(0, size)
	if err != nil {
		return err
	}
	if api == "channel" {
		r, err := b.ch.Recv(dst)
		if err != nil {
			return err
		}
		return r.Wait(ctx)
	}
	r, err := b.irecvStaged(i, size)
	if err != nil {
		return err
	}
	if _, err := r.Wait(ctx); err != nil {
		return err
	}
	return b.unstage(i, dst)
}

func (b *gpuBench) irecvStaged(i, size int) (*transport.Request, error) {
	pb, err := b.pin[i].Bytes()
	if err != nil {
		return nil, err
	}
	return b.t.Irecv(b.peer, 1, pb[:size])
}

// unstage copies a received pinned buffer to the device and synchronizes.
func (b *gpuBench) unstage(i int, dst gpu.Buffer) error {
	p, err := b.pin[i].Slice(0, dst.Len())
	if err != nil {
		return err
	}
	if err := gpu.CopyAsync(b.stream, dst, p); err != nil {
		return err
	}
	return b.stream.Synchronize()
}

// pingpong runs iters round trips and returns each one's time (rank 0's
// measure; rank 1 answers).
func (b *gpuBench) pingpong(ctx context.Context, api string, size, iters int) ([]time.Duration, error) {
	rts := make([]time.Duration, iters)
	for i := range rts {
		start := time.Now()
		if b.t.Rank() == 0 {
			if err := b.send(ctx, api, 0, size); err != nil {
				return nil, err
			}
			if err := b.recv(ctx, api, 0, size); err != nil {
				return nil, err
			}
		} else {
			if err := b.recv(ctx, api, 0, size); err != nil {
				return nil, err
			}
			if err := b.send(ctx, api, 0, size); err != nil {
				return nil, err
			}
		}
		rts[i] = time.Since(start)
	}
	return rts, nil
}

// oneWayUs is half the mean or the median (stat) of round trips rts, in
// microseconds; the median of an even number is the mean of the middle two.
func oneWayUs(rts []time.Duration, stat string) float64 {
	if len(rts) == 0 {
		return 0
	}
	var rt time.Duration
	if stat == "median" {
		s := slices.Clone(rts)
		slices.Sort(s)
		h := len(s) / 2
		rt = s[h]
		if len(s)%2 == 0 {
			rt = (s[h-1] + s[h]) / 2
		}
	} else {
		for _, d := range rts {
			rt += d
		}
		rt /= time.Duration(len(rts))
	}
	return float64(rt.Nanoseconds()) / 1e3 / 2
}

// stream1 runs iters windows: rank 0 sends a window of messages, rank 1
// receives them and acknowledges with one byte.
func (b *gpuBench) stream1(ctx context.Context, api string, size, iters int) (time.Duration, error) {
	w := b.f.window
	start := time.Now()
	for it := 0; it < iters; it++ {
		var err error
		switch {
		case b.t.Rank() == 0 && api == "channel":
			err = window(ctx, w, func(i int) (waiter, error) {
				src, _ := b.dev[i].Slice(0, size)
				r, err := b.ch.Send(src)
				return chanWaiter(r), err
			})
		case b.t.Rank() == 0:
			err = window(ctx, w, func(i int) (waiter, error) {
				src, _ := b.dev[i].Slice(0, size)
				r, err := b.isendStaged(i, src)
				return reqWaiter(r, nil), err
			})
		case api == "channel":
			err = window(ctx, w, func(i int) (waiter, error) {
				dst, _ := b.dev[i].Slice(0, size)
				r, err := b.ch.Recv(dst)
				return chanWaiter(r), err
			})
		default:
			err = window(ctx, w, func(i int) (waiter, error) {
				r, err := b.irecvStaged(i, size)
				return reqWaiter(r, func() error {
					dst, _ := b.dev[i].Slice(0, size)
					return b.unstage(i, dst)
				}), err
			})
		}
		if err != nil {
			return 0, err
		}
		// The receiver acknowledges each window.
		if b.t.Rank() == 0 {
			_, err = b.t.Recv(ctx, 1, 2, b.ack)
		} else {
			err = b.t.Send(ctx, 0, 2, b.ack)
		}
		if err != nil {
			return 0, err
		}
	}
	return time.Since(start), nil
}

// waiter waits for one operation of a window.
type waiter func(ctx context.Context) error

func chanWaiter(r *transport.ChannelRequest) waiter {
	return func(ctx context.Context) error { return r.Wait(ctx) }
}

// reqWaiter waits for r, then runs after (if any).
func reqWaiter(r *transport.Request, after func() error) waiter {
	return func(ctx context.Context) error {
		if _, err := r.Wait(ctx); err != nil {
			return err
		}
		if after != nil {
			return after()
		}
		return nil
	}
}

// window starts w operations, then waits for them in order.
func window(ctx context.Context, w int, start func(i int) (waiter, error)) error {
	ws := make([]waiter, w)
	for i := range ws {
		var err error
		if ws[i], err = start(i); err != nil {
			return err
		}
	}
	for _, wt := range ws {
		if err := wt(ctx); err != nil {
			return err
		}
	}
	return nil
}
