package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/actor"
	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
)

// The GPU Messaging API between two processes of one host on the cuda
// backend over the fake driver: with CUDA IPC on, a message's gpu.Buffer
// field goes as a descriptor and the receiver copies from the sender's
// memory; with it off, the bytes are staged through host memory. Both must
// deliver the same messages, in order, with the same bytes.
func init() {
	scenarios["gpumsgipc"] = gpuMsgIPC
	scenarios["gpumsgagent"] = gpuMsgAgent
	scenarios["gpumsgipcloss"] = gpuMsgIPCLoss
}

// devMsg carries a device buffer whose bytes are pattern(len, Seed).
type devMsg struct {
	N    int
	Seed uint32
	Buf  gpu.Buffer
}

// devMark is a plain message between device messages (ordering).
type devMark struct{ N int }

// devVerdict asks the sink whether N messages arrived intact and in order.
type devVerdict struct{ N int }

func init() {
	actor.MustRegister[devMsg]()
	actor.MustRegister[devMark]()
	actor.MustRegister[devVerdict]()
}

// devBadSize and devBadPairSize are the sizes for which the sink's hook
// returns a buffer one byte short: the second is large enough for the pair
// channel (actor.PairDeviceMin).
const (
	devBadSize     = 777
	devBadPairSize = actor.PairDeviceMin + 1001
)

// devSink checks devMsg and devMark messages: consecutive N, bytes equal to
// the pattern. Its PostReceiveDevice lands each message in a fresh
// allocation (freed after the check), except devBadSize.
type devSink struct {
	dev  *gpu.Device
	next int
	errs []string
	mu   sync.Mutex
	// landings, when set, take the messages of their size in turn, one
	// each (a message may land while the one before is being checked);
	// they are kept, not freed (a free makes the copy agent return).
	landings []gpu.Buffer
	landed   int // PostReceiveDevice's, on the progress goroutine
}

func (s *devSink) PostReceiveDevice(in *actor.Incoming) gpu.Buffer {
	if s.landed < len(s.landings) && in.Size == s.landings[s.landed].Len() {
		s.landed++
		return s.landings[s.landed-1]
	}
	n := in.Size
	if n == devBadSize || n == devBadPairSize {
		n--
	}
	b, err := s.dev.Alloc(n)
	if err != nil {
		return gpu.Buffer{}
	}
	return b
}

func (s *devSink) fail(format string, args ...any) {
	s.mu.Lock()
	s.errs = append(s.errs, fmt.Sprintf(format, args...))
	s.mu.Unlock()
}

func (s *devSink) Receive(c pa.Context) {
	switch m := c.Message().(type) {
	case *devMsg:
		if m.N != s.next {
			s.fail("device message %d arrived when %d was due", m.N, s.next)
		}
		s.next = m.N + 1
		got := make([]byte, m.Buf.Len())
		if err := gpu.CopyToHost(got, m.Buf); err != nil {
			s.fail("message %d: reading its buffer: %v", m.N, err)
		} else if want := pattern(len(got), m.Seed); !bytes.Equal(got, want) {
			s.fail("message %d: %d bytes differ from those sent", m.N, len(got))
		}
		if m.Buf.Kind() != gpu.KindDevice {
			s.fail("message %d landed in %s memory", m.N, m.Buf.Kind())
		}
		if !slices.Contains(s.landings, m.Buf) {
			_ = gpu.Free(m.Buf)
		}
	case *devMark:
		if m.N != s.next {
			s.fail("mark %d arrived when %d was due", m.N, s.next)
		}
		s.next = m.N + 1
	case *devVerdict:
		s.mu.Lock()
		v := &verdict{}
		switch {
		case len(s.errs) > 0:
			v.Err = fmt.Sprint(s.errs)
		case s.next != m.N:
			v.Err = fmt.Sprintf("sink saw %d messages, want %d", s.next, m.N)
		}
		s.mu.Unlock()
		c.Respond(v)
	}
}

// TestGPUMessagingIPC: device-buffer actor messages between two processes
// on the cuda backend (a real GPU when there is one, else the fake driver), with CUDA IPC on and off, over shared memory and
// TCP: bytes, order among plain messages, Send and SendDevice, a landing
// buffer of the wrong size reported on both ends, the transfer path taken.
//
// In the declined case the driver refuses every handle (the fake driver's
// FAKECUDA_IPC_OPEN, as a real driver does for a device the importing
// process cannot reach): each receiver asks for the bytes instead, and the
// messages arrive intact and in order all the same.
func TestGPUMessagingIPC(t *testing.T) {
	useCUDA(t)
	for _, tc := range []struct {
		name, ipc string
		c         cfg
		declined  bool
	}{
		{"shm-ipc", "on", cfg{"shm", "direct"}, false},
		{"tcp-ipc", "on", cfg{"tcp", "direct"}, false},
		{"shm-staged", "off", cfg{"shm", "direct"}, false},
		{"shm-declined", "on", cfg{"shm", "direct"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(transport.EnvGPUIPC, tc.ipc)
			path := fmt.Sprint(tc.ipc == "on")
			if tc.declined {
				if os.Getenv(gpu.EnvCUDALibrary) == "" {
					t.Skip("a driver that refuses CUDA IPC handles is the fake driver's (FAKECUDA_IPC_OPEN); this machine's GPU is in use")
				}
				t.Setenv("FAKECUDA_IPC_OPEN", "217") // CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
				path = "declined"
			}
			res := runJob(t, "gpumsgipc", 2, tc.c)
			for r := 0; r < 2; r++ {
				requireLines(t, res, fmt.Sprintf("[%d] rank %d: gpu backend cuda", r, r),
					fmt.Sprintf("[%d] rank %d: device messages ok", r, r),
					fmt.Sprintf("[%d] rank %d: wrong landing size reported to the sender", r, r),
					fmt.Sprintf("[%d] rank %d: by ipc=%s", r, r, path))
			}
		})
	}
}

// TestGPUMessagingIPCAgent: with the copy agent resident, small device
// messages from a mapping already open are copied where they arrive
// (transport.ImportDeviceNow), not in a goroutine of their own, and still
// arrive intact and in order.
func TestGPUMessagingIPCAgent(t *testing.T) {
	useCUDA(t)
	t.Setenv(gpu.EnvGPUAgent, "on")
	t.Setenv(gpu.EnvGPUAgentIdle, "1m")
	res := runJob(t, "gpumsgagent", 2, cfg{"shm", "direct"})
	requireLines(t, res, fmt.Sprintf("[1] rank 1: %d messages, imported at once %d", msgAgentRounds, msgAgentRounds))
}

// msgAgentRounds is the number of messages gpuMsgAgent measures.
const msgAgentRounds = 8

// gpuMsgAgent is one rank of TestGPUMessagingIPCAgent: rank 0 sends
// 64-byte device messages from one buffer into landing buffers of rank 1's
// sink; the first opens the mapping, then rank 1 warms its agent and
// counts how many of the next msgAgentRounds were imported at once.
func gpuMsgAgent(ctx context.Context, r *rank) error {
	sys, err := openGPU(r)
	if err != nil {
		return err
	}
	defer sys.Close()
	dev := sys.Devices()[0]
	const size = 64
	buf, err := dev.Alloc(size) // rank 0's source
	if err != nil {
		return err
	}
	sink := &devSink{dev: dev}
	for range msgAgentRounds + 1 {
		b, err := dev.Alloc(size)
		if err != nil {
			return err
		}
		sink.landings = append(sink.landings, b)
	}
	return withActors(ctx, r, actor.Options{Device: dev}, func(rt *actor.Runtime) error {
		if _, err := rt.Root().SpawnNamed(rt.Props(func() pa.Actor { return sink }), "devsink"); err != nil {
			return err
		}
		if err := r.b.Barrier(ctx, "gpumsgagent.spawned"); err != nil {
			return err
		}
		var before transport.GPUIPCStats
		for i := -1; i < msgAgentRounds; i++ {
			if i == 0 {
				// The mapping is open now (round -1).
				if r.id() == 1 {
					if err := warmAgent(sys); err != nil {
						return err
					}
				}
				// Rank 0 comes once round -1 was acknowledged, so imported,
				// and sends on only after rank 1's count.
				if err := r.b.Barrier(ctx, "gpumsgagent.warm"); err != nil {
					return err
				}
				before = r.t.GPUIPCStats()
				if err := r.b.Barrier(ctx, "gpumsgagent.counted"); err != nil {
					return err
				}
			}
			if r.id() != 0 {
				continue
			}
			seed := uint32(500 + i)
			if err := gpu.CopyFromHost(buf, pattern(size, seed)); err != nil {
				return err
			}
			// Send returns once rank 1 has copied: buf may be rewritten.
			if err := rt.Send(rt.PID(1, "devsink"), &devMsg{N: i + 1, Seed: seed, Buf: buf}); err != nil {
				return err
			}
		}
		if r.id() == 0 {
			res, err := rt.Request(rt.PID(1, "devsink"), &devVerdict{N: msgAgentRounds + 1}, actorTimeout)
			if err != nil {
				return err
			}
			if v := res.(*verdict); v.Err != "" {
				return errors.New(v.Err)
			}
		}
		if err := r.b.Barrier(ctx, "gpumsgagent.done"); err != nil {
			return err
		}
		if r.id() == 1 {
			after := r.t.GPUIPCStats()
			r.logf("%d messages, imported at once %d", after.Imported-before.Imported, after.ImportedNow-before.ImportedNow)
		}
		return nil
	})
}

// gpuMsgIPC is one rank of TestGPUMessagingIPC: each rank sends to the
// other's sink in turn.
func gpuMsgIPC(ctx context.Context, r *rank) error {
	sys, err := openGPU(r)
	if err != nil {
		return err
	}
	defer sys.Close()
	dev := sys.Devices()[0]
	return withActors(ctx, r, actor.Options{Device: dev}, func(rt *actor.Runtime) error {
		sink := &devSink{dev: dev}
		if _, err := rt.Root().SpawnNamed(rt.Props(func() pa.Actor { return sink }), "devsink"); err != nil {
			return err
		}
		if err := r.b.Barrier(ctx, "gpumsgipc.spawned"); err != nil {
			return err
		}
		ipc := r.t.DeviceIPCPeer(1 - r.id())
		for turn := 0; turn < 2; turn++ {
			if turn == r.id() {
				if err := sendDeviceMessages(ctx, r, rt, sys, ipc); err != nil {
					return err
				}
			}
			if err := r.b.Barrier(ctx, fmt.Sprintf("gpumsgipc.turn%d", turn)); err != nil {
				return err
			}
		}
		st := rt.Stats()
		if os.Getenv("FAKECUDA_IPC_OPEN") != "" {
			// Every descriptor declined: sent as descriptors, the bytes
			// resent and received that way, nothing imported.
			switch {
			case !ipc:
				return errors.New("not a CUDA IPC peer")
			case st.DeviceIPC.Load() != 0 || r.t.GPUIPCStats().Imported != 0:
				return fmt.Errorf("%d device messages copied by IPC with a driver that refuses handles", st.DeviceIPC.Load())
			case st.DeviceIPCSent.Load() == 0 || st.DeviceIPCResent.Load() != st.DeviceIPCSent.Load()-2:
				// The two wrong-size messages are refused before any import.
				return fmt.Errorf("%d descriptors sent, %d resent as bytes: want all but two resent", st.DeviceIPCSent.Load(), st.DeviceIPCResent.Load())
			case st.DeviceIPCDeclined.Load() != st.DeviceIPCResent.Load():
				// Both ranks sent the same messages.
				return fmt.Errorf("%d descriptors declined here, %d resent from here: want equal", st.DeviceIPCDeclined.Load(), st.DeviceIPCResent.Load())
			}
			r.logf("by ipc=declined")
			return nil
		}
		if ipc != (st.DeviceIPC.Load() > 0) || ipc != (st.DeviceIPCSent.Load() > 0) {
			return fmt.Errorf("ipc peer %v, but %d device messages sent and %d received by IPC", ipc, st.DeviceIPCSent.Load(), st.DeviceIPC.Load())
		}
		// Without IPC the large buffers (100,000, 1 MiB + 3 and 200,000
		// bytes, and the wrong-size one) follow on the pair channel.
		if want := uint64(4); !ipc && (st.DevicePairSent.Load() != want || st.DevicePair.Load() != want-1) {
			return fmt.Errorf("%d device buffers sent and %d landed on the pair channel, want %d and %d", st.DevicePairSent.Load(), st.DevicePair.Load(), want, want-1)
		}
		if ipc && st.DevicePairSent.Load()+st.DevicePair.Load() != 0 {
			return fmt.Errorf("%d device buffers sent on the pair channel to a CUDA IPC peer", st.DevicePairSent.Load())
		}
		if st.DeviceIPCDeclined.Load() != 0 || st.DeviceIPCResent.Load() != 0 {
			return fmt.Errorf("%d descriptors declined, %d resent, with a driver that takes handles", st.DeviceIPCDeclined.Load(), st.DeviceIPCResent.Load())
		}
		if g := r.t.GPUIPCStats(); ipc && (g.Exported == 0 || g.Imported == 0 || g.MapHits == 0) {
			return fmt.Errorf("CUDA IPC stats %+v: want exports, imports and mapping cache hits", g)
		}
		r.logf("by ipc=%v", ipc)
		return nil
	})
}

// sendDeviceMessages sends the peer's sink device messages of several
// sizes, by Send and by SendDevice, plain marks between them, and one
// message its hook lands in a buffer of the wrong size; then asks for the
// verdict.
func sendDeviceMessages(ctx context.Context, r *rank, rt *actor.Runtime, sys *gpu.System, ipc bool) error {
	sink := rt.PID(1-r.id(), "devsink")
	n := 0
	sizes := []int{1, 64, 4096, 100_000, 1<<20 + 3}
	// One allocation sliced per message: the receiver's mapping cache
	// serves all but the first.
	whole, err := sys.Devices()[0].Alloc(2 << 20)
	if err != nil {
		return err
	}
	defer gpu.Free(whole)
	for _, size := range sizes {
		buf, err := whole.Slice(0, size)
		if err != nil {
			return err
		}
		seed := uint32(size + r.id())
		if err := gpu.CopyFromHost(buf, pattern(size, seed)); err != nil {
			return err
		}
		if err := rt.Send(sink, &devMsg{N: n, Seed: seed, Buf: buf}); err != nil {
			return fmt.Errorf("Send of %d bytes: %w", size, err)
		}
		n++
		if err := rt.Send(sink, &devMark{N: n}); err != nil {
			return err
		}
		n++
	}
	// SendDevice: several in flight from distinct parts of the allocation.
	var cs []*actor.Completion
	for i, off := 0, 0; i < 6; i, off = i+1, off+8192 {
		buf, err := whole.Slice(off, 5000)
		if err != nil {
			return err
		}
		seed := uint32(1000 + i)
		if err := gpu.CopyFromHost(buf, pattern(5000, seed)); err != nil {
			return err
		}
		c, err := rt.SendDevice(nil, sink, &devMsg{N: n, Seed: seed, Buf: buf})
		if err != nil {
			return fmt.Errorf("SendDevice %d: %w", i, err)
		}
		cs = append(cs, c)
		n++
	}
	for i, c := range cs {
		if err := c.Wait(ctx); err != nil {
			return fmt.Errorf("SendDevice %d completion: %w", i, err)
		}
	}
	// Landing buffers of the wrong size (a dead letter on the receiver,
	// the sink's count stays put): by IPC the sender learns it from Send;
	// staged or on the pair channel, Send has returned, and the receiver
	// tells the sending rank, which publishes the dead letter on its own
	// event stream.
	rejected := make(chan *actor.UndeliverableError, 1)
	sub := rt.System().EventStream.Subscribe(func(ev any) {
		if dl, ok := ev.(*pa.DeadLetterEvent); ok {
			if ue, ok := dl.Message.(*actor.UndeliverableError); ok {
				select {
				case rejected <- ue:
				default:
				}
			}
		}
	})
	defer rt.System().EventStream.Unsubscribe(sub)
	for i, size := range []int{devBadSize, devBadPairSize} {
		bad, err := whole.Slice(0, size)
		if err != nil {
			return err
		}
		err = rt.Send(sink, &devMsg{N: n, Buf: bad})
		var derr *actor.DeviceIPCError
		switch {
		case ipc && !errors.As(err, &derr):
			return fmt.Errorf("Send of %d bytes with a wrong landing size: got %v, want a *DeviceIPCError", size, err)
		case !ipc && err != nil:
			return fmt.Errorf("staged Send of %d bytes with a wrong landing size: %w", size, err)
		case !ipc:
			select {
			case ue := <-rejected:
				if want := fmt.Sprintf("for a device payload of %d", size); !strings.Contains(ue.Reason, want) {
					return fmt.Errorf("staged Send of %d bytes with a wrong landing size: the sending rank heard %q", size, ue.Reason)
				}
			case <-time.After(actorTimeout):
				return fmt.Errorf("staged Send of %d bytes with a wrong landing size: the sending rank never heard", size)
			}
			if got := rt.Stats().DeviceRejected.Load(); got != uint64(i+1) {
				return fmt.Errorf("DeviceRejected = %d, want %d", got, i+1)
			}
		}
	}
	// A large message behind the rejected ones arrives intact and in order
	// (the pair channel's counters stayed in step).
	after, err := whole.Slice(0, 200_000)
	if err != nil {
		return err
	}
	if err := gpu.CopyFromHost(after, pattern(200_000, 77)); err != nil {
		return err
	}
	if err := rt.Send(sink, &devMsg{N: n, Seed: 77, Buf: after}); err != nil {
		return err
	}
	n++
	r.logf("wrong landing size reported to the sender")
	res, err := rt.Request(sink, &devVerdict{N: n}, actorTimeout)
	if err != nil {
		return err
	}
	if v := res.(*verdict); v.Err != "" {
		return errors.New(v.Err)
	}
	r.logf("device messages ok")
	return nil
}

// devKillSize and devKillPairSize are the sizes at which the loss
// scenario's receiver dies inside
// its PostReceiveDevice hook, before it copies or acknowledges.
const (
	devKillSize     = 4242
	devKillPairSize = actor.PairDeviceMin + 4242
)

// killingSink is rank 1's sink in the loss scenario.
type killingSink struct{ dev *gpu.Device }

func (k *killingSink) PostReceiveDevice(in *actor.Incoming) gpu.Buffer {
	if in.Size == devKillSize || in.Size == devKillPairSize {
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	b, _ := k.dev.Alloc(in.Size)
	return b
}

func (k *killingSink) Receive(c pa.Context) {
	if m, ok := c.Message().(*devMsg); ok {
		_ = gpu.Free(m.Buf)
		c.Respond(&devMark{N: m.N})
	}
}

// TestGPUMessagingIPCPeerLost: the receiver of a CUDA IPC device message
// dies before it acknowledges, or, with IPC off, the receiver of a device
// buffer on the pair channel dies before it posts the channel receive; the
// sender's Completion fails with the loss, and so does a later Send.
func TestGPUMessagingIPCPeerLost(t *testing.T) {
	useCUDA(t)
	for _, ipc := range []string{"on", "off"} {
		t.Run("ipc-"+ipc, func(t *testing.T) {
			t.Setenv(transport.EnvGPUIPC, ipc)
			requireRank1Killed(t, "gpumsgipcloss", "[0] rank 0: completion and send failed with the peer lost")
		})
	}
}

// gpuMsgIPCLoss is one rank of TestGPUMessagingIPCPeerLost.
func gpuMsgIPCLoss(ctx context.Context, r *rank) error {
	r.skipFinalBarrier = true // rank 1 will not come
	sys, err := openGPU(r)
	if err != nil {
		return err
	}
	defer sys.Close()
	dev := sys.Devices()[0]
	rt, err := actor.Init(ctx, actor.Options{Transport: r.t, Device: dev})
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = rt.Shutdown(sctx) // rank 1 is gone: its barrier fails
	}()
	if r.id() == 1 {
		if _, err := rt.Root().SpawnNamed(rt.Props(func() pa.Actor { return &killingSink{dev: dev} }), "devsink"); err != nil {
			return err
		}
	}
	if err := r.b.Barrier(ctx, "gpumsgipcloss.spawned"); err != nil {
		return err
	}
	if r.id() == 1 {
		select {} // killed by its hook
	}
	// The launcher stops the survivor (SIGTERM) once rank 1 dies; it
	// finishes its checks first.
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	killSize := devKillSize
	switch ipc := r.t.DeviceIPCPeer(1); {
	case os.Getenv(transport.EnvGPUIPC) == "off" && ipc:
		return errors.New("rank 1 is a CUDA IPC peer with IPC off")
	case os.Getenv(transport.EnvGPUIPC) == "off":
		killSize = devKillPairSize
	case !ipc:
		return fmt.Errorf("rank 1 is not a CUDA IPC peer: %+v", r.t.GPUIPCStats())
	}
	sink := rt.PID(1, "devsink")
	buf, err := devWith(sys, pattern(killSize+1, 3))
	if err != nil {
		return err
	}
	defer gpu.Free(buf)
	// One message first: the ranks are connected when rank 1 dies.
	if _, err := rt.Request(sink, &devMsg{N: 0, Buf: buf}, actorTimeout); err != nil {
		return fmt.Errorf("before the loss: %w", err)
	}
	kill, err := buf.Slice(0, killSize)
	if err != nil {
		return err
	}
	c, err := rt.SendDevice(nil, sink, &devMsg{N: 1, Buf: kill})
	if err != nil {
		return err
	}
	var lost *transport.PeerLostError
	if err := c.Wait(ctx); !errors.As(err, &lost) {
		return fmt.Errorf("completion: got %v, want a *PeerLostError", err)
	}
	if err := rt.Send(sink, &devMsg{N: 2, Buf: buf}); !errors.As(err, &lost) {
		return fmt.Errorf("Send after the loss: got %v, want a *PeerLostError", err)
	}
	if killSize == devKillPairSize && rt.Stats().DevicePairSent.Load() != 2 {
		return fmt.Errorf("%d device buffers sent on the pair channel, want 2", rt.Stats().DevicePairSent.Load())
	}
	r.logf("completion and send failed with the peer lost")
	return nil
}
