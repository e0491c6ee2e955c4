package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/samples/faces/facesim"
	"github.com/troupe-hpc/troupe/transport"
)

// GPU-aware communication between real processes: channels with host and
// device buffers, stream-triggered queues against ordinary tagged operations,
// and the Faces exchange against its serial reference. The gpu backend is the
// one TROUPE_GPU selects (host where there is no GPU); the CUDA variants
// re-run the scenarios with TROUPE_GPU=cuda and skip without a GPU.
func init() {
	scenarios["gpuchannel"] = gpuChannel
	scenarios["gpuqueue"] = gpuQueue
	scenarios["gpufaces"] = gpuFaces
}

// gpuChannelSizes: one message, chunk multiples (empty tail), chunks and a
// tail.
var gpuChannelSizes = []int{0, 8, 65536, transport.ChannelChunkSize, 2*transport.ChannelChunkSize + 4099}

// devWith allocates device memory holding data.
func devWith(sys *gpu.System, data []byte) (gpu.Buffer, error) {
	a, err := sys.Devices()[0].Alloc(max(len(data), 1))
	if err != nil {
		return gpu.Buffer{}, err
	}
	b, err := a.Slice(0, len(data))
	if err != nil {
		return gpu.Buffer{}, err
	}
	return b, gpu.CopyFromHost(b, data)
}

func openGPU(r *rank) (*gpu.System, error) {
	sys, err := gpu.Open()
	if err != nil {
		return nil, err
	}
	r.logf("gpu backend %s", sys.Backend())
	if sys.AgentStats().Enabled {
		if err := warmAgent(sys); err != nil {
			sys.Close()
			return nil, err
		}
	}
	return sys, nil
}

// warmAgent copies 8 bytes from device to pinned memory until the copy
// agent has done one (the first launches it), so that the scenario's own
// small copies find it running. Its two buffers are left to sys.Close:
// freeing them here would make the agent return (gpu.Free quiesces it) and
// the scenario's first copies would find it relaunching, so go to the copy
// engine (seen in CI on a slow machine, under -race).
func warmAgent(sys *gpu.System) error {
	d, err := sys.Devices()[0].Alloc(8)
	if err != nil {
		return err
	}
	h, err := sys.AllocHost(8)
	if err != nil {
		return err
	}
	// A copy of this call's must be the agent's: one made earlier (the
	// agent may have returned since, when memory was freed) proves nothing.
	start := sys.AgentStats().Copies
	for deadline := time.Now().Add(30 * time.Second); sys.AgentStats().Copies == start; {
		if err := gpu.Copy(h, d); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("copy agent did not start: %+v", sys.AgentStats())
		}
	}
	return nil
}

// gpuChannel: rank 0 sends, rank 1 receives, then back, for every pair of
// end kinds (Go bytes, device memory); then size mismatches.
func gpuChannel(ctx context.Context, r *rank) error {
	sys, err := openGPU(r)
	if err != nil {
		return err
	}
	defer sys.Close()
	peer := 1 - r.id()
	ch, err := r.t.Channel(11, peer)
	if err != nil {
		return err
	}
	defer ch.Close()
	kinds := []string{"bytes", "device"}
	for _, n := range gpuChannelSizes {
		for _, sk := range kinds {
			for _, rk := range kinds {
				for dir := 0; dir < 2; dir++ {
					want := pattern(n, uint32(n+dir))
					sending := r.id() == dir
					var req *transport.ChannelRequest
					var dst gpu.Buffer
					var got []byte
					k := rk
					if sending {
						k = sk
					}
					switch {
					case sending && k == "bytes":
						req, err = ch.SendBytes(want)
					case sending:
						var src gpu.Buffer
						if src, err = devWith(sys, want); err == nil {
							req, err = ch.Send(src)
						}
					case k == "bytes":
						got = make([]byte, n)
						req, err = ch.RecvBytes(got)
					default:
						if dst, err = devWith(sys, make([]byte, n)); err == nil {
							req, err = ch.Recv(dst)
						}
					}
					if err != nil {
						return err
					}
					if err := req.Wait(ctx); err != nil {
						return fmt.Errorf("%d B %s->%s (%s): %w", n, sk, rk, req.Path(), err)
					}
					if !sending {
						if k == "device" {
							got = make([]byte, n)
							if err := gpu.CopyToHost(got, dst); err != nil {
								return err
							}
						}
						if d := diff(got, want); d != "" {
							return fmt.Errorf("%d B %s->%s over %s: %s", n, sk, rk, req.Path(), d)
						}
					}
				}
			}
		}
		if r.id() == 1 {
			r.logf("channel %d B ok", n)
		}
	}
	// Size mismatches: rank 0 sends, rank 1 receives into a device buffer of
	// another size and must get a *SizeMismatchError. The sender's side is
	// not told (there is no reply message); it completes.
	for _, c := range [][2]int{{100, 200}, {200, 100}, {transport.ChannelChunkSize + 10, transport.ChannelChunkSize + 30}, {transport.ChannelChunkSize, 2 * transport.ChannelChunkSize}} {
		if r.id() == 0 {
			req, err := ch.SendBytes(pattern(c[0], 1))
			if err != nil {
				return err
			}
			if err := req.Wait(ctx); err != nil {
				return fmt.Errorf("mismatch %v: sender: %w", c, err)
			}
			continue
		}
		dst, err := devWith(sys, make([]byte, c[1]))
		if err != nil {
			return err
		}
		req, err := ch.Recv(dst)
		if err != nil {
			return err
		}
		err = req.Wait(ctx)
		var sm *transport.SizeMismatchError
		if !errors.As(err, &sm) || sm.Want != c[1] {
			return fmt.Errorf("sent %d B, received into %d B: got %v, want a *SizeMismatchError", c[0], c[1], err)
		}
		r.logf("mismatch: %v", err)
	}
	if err := agentRounds(ctx, r, sys, ch); err != nil {
		return err
	}
	if err := typedRounds(ctx, r, sys, ch); err != nil {
		return err
	}
	// The channel still works.
	want := pattern(1000, 9)
	if r.id() == 0 {
		req, err := ch.SendBytes(want)
		if err != nil {
			return err
		}
		if err := req.Wait(ctx); err != nil {
			return err
		}
		return nil
	}
	got := make([]byte, 1000)
	req, err := ch.RecvBytes(got)
	if err != nil {
		return err
	}
	if err := req.Wait(ctx); err != nil {
		return err
	}
	if !bytes.Equal(got, want) {
		return errors.New("data after the mismatches differs")
	}
	r.logf("channel size mismatches reported")
	r.logf("gpu ipc enabled=%v", r.t.GPUIPCStats().Enabled)
	return nil
}

// agentRounds sends an 8-byte device buffer from rank 0 to a device buffer
// on rank 1, agentRoundCount times, with the copy agent warmed first and no
// memory freed in between (a free makes the agent return), and logs whether
// every round's small copies were the agent's: the receiver's (IPC or
// unstaging) and, when the message is staged, the sender's too. Nothing
// else copies meanwhile, so with the agent resident each round's copies
// must find it idle and take it.
func agentRounds(ctx context.Context, r *rank, sys *gpu.System, ch *transport.Channel) error {
	a := sys.AgentStats()
	if !a.Enabled {
		r.logf("copy agent enabled=false")
		return nil
	}
	want := pattern(8, 4242)
	buf, err := devWith(sys, want)
	if err != nil {
		return err
	}
	var path transport.TransferPath
	var before gpu.AgentStats
	for i := -1; i < agentRoundCount; i++ {
		if i == 0 {
			// After round -1, which opened the IPC mapping of the
			// sender's buffer (evicting an older one closes it, and that
			// makes the agent return).
			if err := warmAgent(sys); err != nil {
				return err
			}
			before = sys.AgentStats()
		}
		var req *transport.ChannelRequest
		if r.id() == 0 {
			req, err = ch.Send(buf)
		} else {
			req, err = ch.Recv(buf)
		}
		if err != nil {
			return err
		}
		if err := req.Wait(ctx); err != nil {
			return fmt.Errorf("agent round %d: %w", i, err)
		}
		path = req.Path()
	}
	if r.id() == 1 {
		got := make([]byte, 8)
		if err := gpu.CopyToHost(got, buf); err != nil {
			return err
		}
		if d := diff(got, want); d != "" {
			return fmt.Errorf("agent rounds: %s", d)
		}
	}
	after := sys.AgentStats()
	r.logf("copy agent enabled=true path=%s rounds=%d copies=%d failures=%d", path, agentRoundCount, after.Copies-before.Copies, after.Failures)
	return nil
}

// agentRoundCount is the number of messages agentRounds sends.
const agentRoundCount = 8

// gpuQueue: each rank's enqueued sends meet the other's ordinary receives,
// and its enqueued receives the other's ordinary sends.
func gpuQueue(ctx context.Context, r *rank) error {
	sys, err := openGPU(r)
	if err != nil {
		return err
	}
	defer sys.Close()
	s, err := sys.Devices()[0].NewStream()
	if err != nil {
		return err
	}
	defer s.Destroy()
	q, err := r.t.NewQueue(s)
	if err != nil {
		return err
	}
	peer := 1 - r.id()
	sizes := []int{8, 70000, 1 << 20}
	for iter := 0; iter < 3; iter++ {
		var plain []*transport.Request
		var got [][]byte
		var dsts []gpu.Buffer
		for i, n := range sizes {
			seed := uint32(100*iter + 10*r.id() + i)
			src, err := devWith(sys, pattern(n, seed))
			if err != nil {
				return err
			}
			if _, err := q.EnqueueSend(src, peer, 30+i); err != nil {
				return err
			}
			dst, err := devWith(sys, make([]byte, n))
			if err != nil {
				return err
			}
			if _, err := q.EnqueueRecv(dst, peer, 50+i); err != nil {
				return err
			}
			dsts = append(dsts, dst)
			g := make([]byte, n)
			rq, err := r.t.Irecv(peer, 30+i, g)
			if err != nil {
				return err
			}
			got = append(got, g)
			sq, err := r.t.Isend(peer, 50+i, pattern(n, uint32(1000+100*iter+10*r.id()+i)))
			if err != nil {
				return err
			}
			plain = append(plain, rq, sq)
		}
		if err := q.Start(); err != nil {
			return err
		}
		if err := q.Wait(); err != nil {
			return err
		}
		for _, p := range plain {
			if _, err := p.Wait(ctx); err != nil {
				return err
			}
		}
		if err := s.Synchronize(); err != nil {
			return err
		}
		for i, n := range sizes {
			if d := diff(got[i], pattern(n, uint32(100*iter+10*peer+i))); d != "" {
				return fmt.Errorf("iter %d: ordinary receive of an enqueued send of %d B: %s", iter, n, d)
			}
			out := make([]byte, n)
			if err := gpu.CopyToHost(out, dsts[i]); err != nil {
				return err
			}
			if d := diff(out, pattern(n, uint32(1000+100*iter+10*peer+i))); d != "" {
				return fmt.Errorf("iter %d: enqueued receive of an ordinary send of %d B: %s", iter, n, d)
			}
		}
	}
	if err := queueTyped(ctx, r, sys, s, q); err != nil {
		return err
	}
	if err := q.Free(); err != nil {
		return err
	}
	r.logf("queue ops matched ordinary tagged ops")
	return nil
}

// queueTyped exchanges derived-datatype layouts between the two ranks'
// queues: each sends a vector of stride 7 from device memory and receives
// it into a vector of stride 9, and checks every byte of its buffer
// against datatype's Pack and Unpack on host memory.
func queueTyped(ctx context.Context, r *rank, sys *gpu.System, s *gpu.Stream, q *transport.Queue) error {
	const n = 40000 // blocks of 4 float64s: 1.28 MB packed
	v7, err := datatype.Vector(n, 4, 7, datatype.Float64)
	if err != nil {
		return err
	}
	v9, err := datatype.Vector(n, 4, 9, datatype.Float64)
	if err != nil {
		return err
	}
	peer := 1 - r.id()
	mine, theirs := pattern(int(v7.Extent()), uint32(7+r.id())), pattern(int(v7.Extent()), uint32(7+peer))
	old := pattern(int(v9.Extent()), 77)
	src, err := devWith(sys, mine)
	if err != nil {
		return err
	}
	dst, err := devWith(sys, old)
	if err != nil {
		return err
	}
	so, err := q.EnqueueSendTyped(src, v7, 1, peer, 70)
	if err != nil {
		return err
	}
	ro, err := q.EnqueueRecvTyped(dst, v9, 1, peer, 70)
	if err != nil {
		return err
	}
	if err := q.Start(); err != nil {
		return err
	}
	if err := q.Wait(); err != nil {
		return err
	}
	if err := s.Synchronize(); err != nil {
		return err
	}
	for _, o := range []*transport.QueueOp{so, ro} {
		if _, err := o.Wait(ctx); err != nil {
			return fmt.Errorf("typed queue op: %w", err)
		}
	}
	if err := checkTyped(dst, v7, v9, theirs, old); err != nil {
		return fmt.Errorf("typed queue receive: %w", err)
	}
	r.logf("typed queue ops ok")
	return nil
}

// gpuFaces: the Faces exchange in both modes against the serial reference.
func gpuFaces(ctx context.Context, r *rank) error {
	sys, err := openGPU(r)
	if err != nil {
		return err
	}
	defer sys.Close()
	fr, err := facesim.NewRank(r.t, sys, facesim.Config{L: 5, Iters: 4})
	if err != nil {
		return err
	}
	defer fr.Close()
	for _, m := range []string{facesim.ModeQueue, facesim.ModePlain} {
		fr.Reset()
		if err := r.b.Barrier(ctx, "faces."+m); err != nil {
			return err
		}
		if _, err := fr.Iterate(ctx, m); err != nil {
			return fmt.Errorf("%s: %w", m, err)
		}
		if err := fr.Check(); err != nil {
			return fmt.Errorf("%s: %w", m, err)
		}
		r.logf("faces %s matches the reference", m)
	}
	return nil
}

func requireLines(t *testing.T, res jobResult, lines ...string) {
	t.Helper()
	for _, l := range lines {
		if !strings.Contains(res.stdout, l) {
			t.Fatalf("missing %q:\n%s", l, res.dump())
		}
	}
}

func TestGPUChannels(t *testing.T) {
	forTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "gpuchannel", 2, c)
		requireLines(t, res, fmt.Sprintf("[1] rank 1: channel %d B ok", gpuChannelSizes[len(gpuChannelSizes)-1]),
			"[1] rank 1: channel size mismatches reported",
			typedChannelLine, typedPipelinedLine(false)[0], typedPipelinedLine(false)[1])
	})
}

func TestGPUChannelsEngine(t *testing.T) {
	// Channel receives go through the overlap engine (issue 7).
	t.Setenv(transport.OverlapEnv, "on")
	res := runJob(t, "gpuchannel", 2, cfg{"shm", "direct"})
	requireLines(t, res, fmt.Sprintf("[1] rank 1: channel %d B ok", gpuChannelSizes[len(gpuChannelSizes)-1]),
		"[1] rank 1: channel size mismatches reported")
}

func TestGPUQueue(t *testing.T) {
	for _, tc := range []struct {
		tls    string
		engine bool
	}{{"tcp", false}, {"shm", false}, {"shm", true}} {
		name := tc.tls
		if tc.engine {
			// Queue receives go through the overlap engine (issue 7).
			name += "-engine"
		}
		t.Run(name, func(t *testing.T) {
			if tc.engine {
				t.Setenv(transport.OverlapEnv, "on")
			}
			res := runJob(t, "gpuqueue", 2, cfg{tc.tls, "direct"})
			requireLines(t, res, "[0] rank 0: queue ops matched ordinary tagged ops", "[1] rank 1: queue ops matched ordinary tagged ops",
				"[0] rank 0: typed queue ops ok", "[1] rank 1: typed queue ops ok")
		})
	}
}

func TestGPUFaces(t *testing.T) {
	res := runJob(t, "gpufaces", 4, cfg{"shm", "direct"})
	for r := 0; r < 4; r++ {
		requireLines(t, res, fmt.Sprintf("[%d] rank %d: faces queue matches the reference", r, r),
			fmt.Sprintf("[%d] rank %d: faces plain matches the reference", r, r))
	}
}

// TestGPUCUDA re-runs the scenarios on the cuda backend. It needs a GPU and
// skips, naming the reason, without one.
// TestGPUQueueCUDA runs the queue scenario on the cuda backend: on this
// machine's GPU, else on the test driver with gpupack's kernels compiled
// in (typed operations pack on the device), stream memory operations and
// staging included.
func TestGPUQueueCUDA(t *testing.T) {
	useCUDA(t)
	res := runJob(t, "gpuqueue", 2, cfg{"shm", "direct"})
	requireLines(t, res, "[0] rank 0: gpu backend cuda", "[1] rank 1: queue ops matched ordinary tagged ops",
		"[0] rank 0: typed queue ops ok", "[1] rank 1: typed queue ops ok")
}

func TestGPUCUDA(t *testing.T) {
	if err := gpu.CUDAAvailable(); err != nil {
		t.Skipf("cuda backend skipped: no CUDA driver/device: %v", err)
	}
	t.Setenv(gpu.EnvBackend, gpu.BackendCUDA)
	for _, role := range []string{"gpuchannel", "gpuqueue"} {
		t.Run(role, func(t *testing.T) {
			res := runJob(t, role, 2, cfg{"shm", "direct"})
			requireLines(t, res, "[0] rank 0: gpu backend cuda")
		})
	}
	t.Run("gpufaces", func(t *testing.T) { runJob(t, "gpufaces", 4, cfg{"shm", "direct"}) })
}

// typedChannelLine is what rank 1 of gpuchannel logs after typedRounds: two
// channel receives and one tagged receive unpacked on the device, one
// channel receive in place (the tagged receive into Go memory is the plain
// typed API's).
const typedChannelLine = "[1] rank 1: typed channel ok: 3 packed on the device, 0 in host memory, 1 in place"

// typedPipelinedLine is what ranks 0 and 1 of gpuchannel log after
// typedRounds: the sender's two device channel sends and the receiver's two
// device channel receives (over two chunks: packed, or unpacked, chunk by
// chunk, unless they go by CUDA IPC), the sender's two tagged device sends
// and the receiver's one tagged device receive, were pipelined.
func typedPipelinedLine(ipc bool) [2]string {
	sends, recvs := 4, 3
	if ipc {
		sends, recvs = 2, 1
	}
	return [2]string{fmt.Sprintf("[0] rank 0: typed transfers pipelined: %d", sends), fmt.Sprintf("[1] rank 1: typed transfers pipelined: %d", recvs)}
}

// typedRounds sends derived-datatype layouts from rank 0 to rank 1 with
// the channel's SendTyped and RecvTyped, and with the tagged API's
// SendTypedBuffer and RecvTypedBuffer: vectors of two strides and a contiguous run,
// device and host memory, packed sizes over two channel chunks. Rank 1
// checks every byte of its buffer against datatype's Pack and Unpack on
// host memory (gaps keep what they held) and logs the typed counters.
func typedRounds(ctx context.Context, r *rank, sys *gpu.System, ch *transport.Channel) error {
	const n = 40000 // blocks of 4 float64s: 1.28 MB packed
	v7, err := datatype.Vector(n, 4, 7, datatype.Float64)
	if err != nil {
		return err
	}
	v9, err := datatype.Vector(n, 4, 9, datatype.Float64)
	if err != nil {
		return err
	}
	run, err := datatype.Contiguous(4*n, datatype.Float64)
	if err != nil {
		return err
	}
	rounds := []struct {
		send, recv       *datatype.Type
		sendDev, recvDev bool
		tagged           bool // SendTypedBuffer and RecvTypedBuffer, not the channel
	}{{v7, v9, true, true, false}, {v7, run, true, false, false}, {v9, v7, false, true, false},
		{v7, v9, true, true, true}, {v9, run, true, false, true}}
	for i, rd := range rounds {
		src := pattern(int(rd.send.Extent()), uint32(i+1))
		old := pattern(int(rd.recv.Extent()), uint32(i+50))
		buf := func(dev bool, data []byte) (gpu.Buffer, error) {
			if dev {
				return devWith(sys, data)
			}
			return sys.HostBuffer(bytes.Clone(data)), nil
		}
		if r.id() == 0 {
			b, err := buf(rd.sendDev, src)
			if err != nil {
				return err
			}
			if rd.tagged {
				if err := r.t.SendTypedBuffer(ctx, 1, 80, b, rd.send, 1); err != nil {
					return fmt.Errorf("typed round %d: tagged send: %w", i, err)
				}
				continue
			}
			req, err := ch.SendTyped(b, rd.send, 1)
			if err != nil {
				return err
			}
			if err := req.Wait(ctx); err != nil {
				return fmt.Errorf("typed round %d: send: %w", i, err)
			}
			continue
		}
		b, err := buf(rd.recvDev, old)
		if err != nil {
			return err
		}
		if rd.tagged {
			if _, err := r.t.RecvTypedBuffer(ctx, 0, 80, b, rd.recv, 1); err != nil {
				return fmt.Errorf("typed round %d: tagged recv: %w", i, err)
			}
			if err := checkTyped(b, rd.send, rd.recv, src, old); err != nil {
				return fmt.Errorf("typed round %d (tagged): %w", i, err)
			}
			continue
		}
		req, err := ch.RecvTyped(b, rd.recv, 1)
		if err != nil {
			return err
		}
		if err := req.Wait(ctx); err != nil {
			return fmt.Errorf("typed round %d: recv (%s): %w", i, req.Path(), err)
		}
		if err := checkTyped(b, rd.send, rd.recv, src, old); err != nil {
			return fmt.Errorf("typed round %d over %s: %w", i, req.Path(), err)
		}
	}
	s := r.t.ChannelTypedStats()
	if r.id() == 1 {
		r.logf("typed channel ok: %d packed on the device, %d in host memory, %d in place", s.DevicePacked, s.HostPacked, s.Run)
	}
	r.logf("typed transfers pipelined: %d", s.Pipelined)
	return nil
}

// checkTyped reports how dst differs from what one element of recv holds
// after receiving one element of send taken from src, over a buffer that
// held old: datatype's Pack and Unpack on host memory.
func checkTyped(dst gpu.Buffer, send, recv *datatype.Type, src, old []byte) error {
	n, err := send.PackedSize(1)
	if err != nil {
		return err
	}
	packed, want := make([]byte, n), bytes.Clone(old)
	if _, err := send.Pack(packed, src, 0, 1); err != nil {
		return err
	}
	if _, err := recv.Unpack(want, packed, 0, 1); err != nil {
		return err
	}
	got := make([]byte, dst.Len())
	if err := gpu.CopyToHost(got, dst); err != nil {
		return err
	}
	if d := diff(got, want); d != "" {
		return errors.New(d)
	}
	return nil
}
