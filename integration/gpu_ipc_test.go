package integration

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/internal/cudatest"
	"github.com/troupe-hpc/troupe/transport"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

// CUDA IPC for channels between two processes of one host, on the cuda
// backend, over real UCX: on a GPU machine with the real driver, elsewhere
// over the fake driver (gpu/testdata/fakecuda: device memory is a shared
// memfd another process can map).
func init() {
	scenarios["gpuipc"] = gpuIPC
	scenarios["gpuipcloss"] = gpuIPCLoss
}

// buildFakeCUDA builds the test driver (internal/cudatest) with gpupack's
// kernels (typed channel transfers); it skips without a C compiler.
func buildFakeCUDA(t *testing.T) string {
	t.Helper()
	lib, err := cudatest.Build(t.TempDir(), "../gpupack/kernels.cu")
	if errors.Is(err, cudatest.ErrNoCompiler) {
		t.Skipf("cannot build the fake CUDA driver: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	return lib
}

// useCUDA makes the ranks of the test's jobs use the cuda backend: on the
// real driver when this machine has a usable GPU (and TROUPE_CUDA_LIBRARY
// names no other driver), else on the fake driver.
func useCUDA(t *testing.T) {
	t.Helper()
	t.Setenv(gpu.EnvBackend, gpu.BackendCUDA)
	if os.Getenv(gpu.EnvCUDALibrary) == "" && gpu.CUDAAvailable() == nil {
		t.Log("cuda backend on this machine's GPU")
		return
	}
	t.Setenv(gpu.EnvCUDALibrary, buildFakeCUDA(t))
}

// TestGPUChannelIPC: device buffers cross a channel by CUDA IPC between two
// processes, over shared memory and over TCP: bytes, paths, ordering, the
// mapping cache, fallback for Go memory, size mismatches on both ends, and
// every mapping closed with the channel.
func TestGPUChannelIPC(t *testing.T) {
	useCUDA(t)
	for _, tc := range []struct {
		name string
		c    cfg
		env  []string
	}{
		{"shm", cfg{"shm", "direct"}, nil},
		{"tcp", cfg{"tcp", "direct"}, nil},
		{"shm-queue", cfg{"shm", "queue"}, nil},
		// Channel data (after headers, and declined descriptors) through the overlap engine.
		{"shm-engine", cfg{"shm", "direct"}, []string{transport.OverlapEnv, "on"}},
		// Small IPC copies by the copy agent (gpu/agent.go).
		{"shm-agent", cfg{"shm", "direct"}, []string{gpu.EnvGPUAgent, "on", gpu.EnvGPUAgentIdle, "1m"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for i := 0; i+1 < len(tc.env); i += 2 {
				t.Setenv(tc.env[i], tc.env[i+1])
			}
			res := runJob(t, "gpuipc", 2, tc.c)
			for r := 0; r < 2; r++ {
				requireLines(t, res, fmt.Sprintf("[%d] rank %d: gpu backend cuda", r, r),
					fmt.Sprintf("[%d] rank %d: ipc sizes ok", r, r),
					fmt.Sprintf("[%d] rank %d: ipc order ok", r, r),
					fmt.Sprintf("[%d] rank %d: ipc mismatches reported on both ends", r, r),
					fmt.Sprintf("[%d] rank %d: ipc cancelled wait lost nothing", r, r),
					fmt.Sprintf("[%d] rank %d: ipc mappings closed", r, r),
					fmt.Sprintf("[%d] rank %d: ipc receive withdrawn by Close", r, r))
			}
			requireLines(t, res, "[1] rank 1: ipc cache: 4 sends of one buffer, 1 mapping opened")
			if tc.name == "shm-agent" {
				// Only the receiver copies (from the sender's mapped buffer).
				requireLines(t, res, fmt.Sprintf("[1] rank 1: copy agent enabled=true path=ipc rounds=%d copies=%d failures=0", agentRoundCount, agentRoundCount))
			}
		})
	}
}

// TestGPUChannelsCUDAIPC runs the generic channel scenario (every pair of
// Go and device memory, size mismatches) on the cuda backend (real or fake
// driver, see useCUDA) with the
// IPC path on and off: with it on, device sends go by IPC or, to Go memory,
// fall back; with it off, staging carries everything, also with the copy
// agent doing the small staging copies.
func TestGPUChannelsCUDAIPC(t *testing.T) {
	useCUDA(t)
	for _, tc := range []struct{ ipc, agent string }{{"on", "off"}, {"off", "off"}, {"off", "on"}} {
		t.Run("ipc-"+tc.ipc+"-agent-"+tc.agent, func(t *testing.T) {
			t.Setenv(transport.EnvGPUIPC, tc.ipc)
			t.Setenv(gpu.EnvGPUAgent, tc.agent)
			t.Setenv(gpu.EnvGPUAgentIdle, "1m") // resident for the whole job: every small copy after the first is the agent's
			res := runJob(t, "gpuchannel", 2, cfg{"shm", "direct"})
			requireLines(t, res, "[0] rank 0: gpu backend cuda",
				fmt.Sprintf("[1] rank 1: channel %d B ok", gpuChannelSizes[len(gpuChannelSizes)-1]),
				"[1] rank 1: channel size mismatches reported", typedChannelLine,
				typedPipelinedLine(tc.ipc == "on")[0], typedPipelinedLine(tc.ipc == "on")[1],
				fmt.Sprintf("[1] rank 1: gpu ipc enabled=%v", tc.ipc == "on"))
			if tc.agent == "on" {
				// Staged small messages: the sender stages, the receiver
				// unstages, each by its agent.
				line := fmt.Sprintf("copy agent enabled=true path=staged rounds=%d copies=%d failures=0", agentRoundCount, agentRoundCount)
				requireLines(t, res, "[0] rank 0: "+line, "[1] rank 1: "+line)
			}
		})
	}
}

// gpuIPC is one rank of TestGPUChannelIPC.
func gpuIPC(ctx context.Context, r *rank) error {
	sys, err := openGPU(r)
	if err != nil {
		return err
	}
	defer sys.Close()
	if sys.Backend() != gpu.BackendCUDA {
		return fmt.Errorf("want the cuda backend, have %s", sys.Backend())
	}
	st := r.t.GPUIPCStats()
	if !st.Enabled || st.Peers != 1 || !r.t.SameHost(1-r.id()) {
		return fmt.Errorf("CUDA IPC not usable with the peer: %+v, same host %v", st, r.t.SameHost(1-r.id()))
	}
	peer := 1 - r.id()
	ch, err := r.t.Channel(21, peer)
	if err != nil {
		return err
	}
	closed := false
	defer func() {
		if !closed {
			ch.Close()
		}
	}()
	// devBuf: device memory holding data; free releases it.
	devBuf := func(data []byte) (gpu.Buffer, error) { return devWith(sys, data) }
	readDev := func(b gpu.Buffer) ([]byte, error) {
		out := make([]byte, b.Len())
		return out, gpu.CopyToHost(out, b)
	}

	// 1. Sizes, both directions, device to device: by IPC at both ends.
	for _, n := range []int{1, 8, 65536, transport.ChannelChunkSize, 2*transport.ChannelChunkSize + 4099} {
		for dir := 0; dir < 2; dir++ {
			want := pattern(n, uint32(7*n+dir))
			var req *transport.ChannelRequest
			var dst gpu.Buffer
			if r.id() == dir {
				src, err := devBuf(want)
				if err != nil {
					return err
				}
				if req, err = ch.Send(src); err != nil {
					return err
				}
				defer gpu.Free(src)
			} else {
				if dst, err = devBuf(make([]byte, n)); err != nil {
					return err
				}
				if req, err = ch.Recv(dst); err != nil {
					return err
				}
			}
			if err := req.Wait(ctx); err != nil {
				return fmt.Errorf("%d B dir %d: %w", n, dir, err)
			}
			if p := req.Path(); p != transport.PathIPC {
				return fmt.Errorf("%d B dir %d: path %s, want ipc", n, dir, p)
			}
			if r.id() != dir {
				got, err := readDev(dst)
				if err != nil {
					return err
				}
				if d := diff(got, want); d != "" {
					return fmt.Errorf("%d B dir %d: %s", n, dir, d)
				}
				gpu.Free(dst)
			}
		}
	}
	r.logf("ipc sizes ok")

	// 2. Ordering: rank 0 posts a burst of sends of several kinds without
	// waiting (device, Go memory, device), rank 1 posts its receives (device,
	// device, Go memory) and each gets its own message. Device to Go memory
	// falls back to the direct path; Go memory to device follows a header.
	const burst = 9
	kindOf := func(i int, sending bool) string {
		if sending && i%3 == 1 || !sending && i%3 == 2 {
			return "bytes"
		}
		return "device"
	}
	before := r.t.GPUIPCStats()
	var reqs []*transport.ChannelRequest
	var dsts []gpu.Buffer
	var gots [][]byte
	for i := 0; i < burst; i++ {
		n := 1000 + 37*i
		if i == 4 {
			n = transport.ChannelChunkSize + 11
		}
		want := pattern(n, uint32(500+i))
		var req *transport.ChannelRequest
		switch {
		case r.id() == 0 && kindOf(i, true) == "bytes":
			req, err = ch.SendBytes(want)
		case r.id() == 0:
			var src gpu.Buffer
			if src, err = devBuf(want); err == nil {
				defer gpu.Free(src)
				req, err = ch.Send(src)
			}
		case kindOf(i, false) == "bytes":
			g := make([]byte, n)
			gots = append(gots, g)
			dsts = append(dsts, gpu.Buffer{})
			req, err = ch.RecvBytes(g)
		default:
			var dst gpu.Buffer
			if dst, err = devBuf(make([]byte, n)); err == nil {
				gots = append(gots, nil)
				dsts = append(dsts, dst)
				req, err = ch.Recv(dst)
			}
		}
		if err != nil {
			return err
		}
		reqs = append(reqs, req)
	}
	for i, req := range reqs {
		if err := req.Wait(ctx); err != nil {
			return fmt.Errorf("burst message %d: %w", i, err)
		}
	}
	for i := 0; r.id() == 1 && i < burst; i++ {
		got := gots[i]
		if got == nil {
			if got, err = readDev(dsts[i]); err != nil {
				return err
			}
			gpu.Free(dsts[i])
		}
		n := 1000 + 37*i
		if i == 4 {
			n = transport.ChannelChunkSize + 11
		}
		if d := diff(got, pattern(n, uint32(500+i))); d != "" {
			return fmt.Errorf("burst message %d (%s -> %s, path %s): %s", i, kindOf(i, true), kindOf(i, false), reqs[i].Path(), d)
		}
		wantPath := transport.PathIPC
		switch {
		case kindOf(i, false) == "bytes":
			wantPath = transport.PathDirect // declined: Go memory
		case kindOf(i, true) == "bytes":
			wantPath = transport.PathStaged // UCX without CUDA support
		}
		if p := reqs[i].Path(); p != wantPath {
			return fmt.Errorf("burst message %d (%s -> %s): path %s, want %s", i, kindOf(i, true), kindOf(i, false), p, wantPath)
		}
	}
	after := r.t.GPUIPCStats()
	if r.id() == 1 && after.Fallbacks-before.Fallbacks != 3 {
		return fmt.Errorf("burst: %d IPC descriptors declined, want 3 (Go memory receives of device sends)", after.Fallbacks-before.Fallbacks)
	}
	r.logf("ipc order ok")

	// 3. The mapping cache: rank 0 sends one device buffer four times
	// (rewriting it in between); rank 1 opens it once.
	src, err := devBuf(make([]byte, 4096))
	if err != nil {
		return err
	}
	defer gpu.Free(src)
	ipcBefore := sys.IPCStats()
	tBefore := r.t.GPUIPCStats()
	for i := 0; i < 4; i++ {
		want := pattern(4096, uint32(900+i))
		if r.id() == 0 {
			if err := gpu.CopyFromHost(src, want); err != nil {
				return err
			}
			req, err := ch.Send(src)
			if err != nil {
				return err
			}
			if err := req.Wait(ctx); err != nil {
				return err
			}
			continue
		}
		dst, err := devBuf(make([]byte, 4096))
		if err != nil {
			return err
		}
		req, err := ch.Recv(dst)
		if err != nil {
			return err
		}
		if err := req.Wait(ctx); err != nil {
			return err
		}
		got, err := readDev(dst)
		if err != nil {
			return err
		}
		gpu.Free(dst)
		if d := diff(got, want); d != "" {
			return fmt.Errorf("cache round %d: %s", i, d)
		}
	}
	if r.id() == 1 {
		ipcAfter, tAfter := sys.IPCStats(), r.t.GPUIPCStats()
		if opened := ipcAfter.Opened - ipcBefore.Opened; opened != 1 {
			return fmt.Errorf("cache: 4 sends of one buffer opened %d mappings, want 1", opened)
		}
		if misses, hits := tAfter.MapMisses-tBefore.MapMisses, tAfter.MapHits-tBefore.MapHits; misses != 1 || hits != 3 {
			return fmt.Errorf("cache: %d misses and %d hits, want 1 and 3", misses, hits)
		}
		r.logf("ipc cache: 4 sends of one buffer, 1 mapping opened")
	}

	// 4. Size mismatches by IPC: both ends fail, naming both sizes; the
	// channel goes on.
	for _, c := range [][2]int{{100, 200}, {transport.ChannelChunkSize + 30, transport.ChannelChunkSize + 10}} {
		sending := r.id() == 0
		n := c[1]
		if sending {
			n = c[0]
		}
		b, err := devBuf(pattern(n, 3))
		if err != nil {
			return err
		}
		var req *transport.ChannelRequest
		if sending {
			req, err = ch.Send(b)
		} else {
			req, err = ch.Recv(b)
		}
		if err != nil {
			return err
		}
		err = req.Wait(ctx)
		gpu.Free(b)
		var sm *transport.SizeMismatchError
		if !errors.As(err, &sm) || sm.Want != n || sm.Got != c[0]+c[1]-n {
			return fmt.Errorf("mismatch %v: got %v, want a *SizeMismatchError with sizes %d and %d", c, err, n, c[0]+c[1]-n)
		}
		r.logf("mismatch: %v", err)
	}
	if err := exchangeOne(ctx, ch, sys, r.id() == 0, 3000); err != nil {
		return fmt.Errorf("after the mismatches: %w", err)
	}
	r.logf("ipc mismatches reported on both ends")

	// 5. A Wait whose context ended returns the context's error; the
	// transfer goes on and a later Wait completes it with the data.
	want := pattern(70000, 41)
	var req *transport.ChannelRequest
	var dst gpu.Buffer
	if r.id() == 1 {
		if dst, err = devBuf(make([]byte, len(want))); err != nil {
			return err
		}
		defer gpu.Free(dst)
		if req, err = ch.Recv(dst); err != nil {
			return err
		}
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		if err := req.Wait(cctx); !errors.Is(err, context.Canceled) {
			return fmt.Errorf("wait with a cancelled context: %v, want context.Canceled", err)
		}
	}
	if err := r.b.Barrier(ctx, "gpuipc.cancel"); err != nil {
		return err
	}
	if r.id() == 0 {
		src, err := devBuf(want)
		if err != nil {
			return err
		}
		defer gpu.Free(src)
		if req, err = ch.Send(src); err != nil {
			return err
		}
	}
	if err := req.Wait(ctx); err != nil {
		return fmt.Errorf("after a cancelled wait: %w", err)
	}
	if r.id() == 1 {
		got, err := readDev(dst)
		if err != nil {
			return err
		}
		if d := diff(got, want); d != "" || req.Path() != transport.PathIPC {
			return fmt.Errorf("after a cancelled wait (path %s): %s", req.Path(), d)
		}
	}
	r.logf("ipc cancelled wait lost nothing")

	if err := agentRounds(ctx, r, sys, ch); err != nil {
		return err
	}

	// 6. Closing the channel closes its mappings.
	closed = true
	if err := ch.Close(); err != nil {
		return err
	}
	if s := sys.IPCStats(); s.Open != 0 || s.Refs != 0 || s.Opened != s.Closed {
		return fmt.Errorf("after Close: IPC mappings left open: %+v", s)
	}
	st = r.t.ChannelStats().IPC
	if st.Sent == 0 || st.Received == 0 {
		return fmt.Errorf("no transfer counted as IPC: %+v", st)
	}
	r.logf("ipc stats %+v", st)
	r.logf("ipc mappings closed")
	return ipcWithdrawnRecv(ctx, r, sys)
}

// ipcWithdrawnRecv: rank 1 posts a receive on channel 22 and closes the
// channel before rank 0 sends; Close withdraws the receive, which waits
// for its control message (it fails with ErrClosed). Rank 1 reopens the
// id and posts a receive, then rank 0 sends: the new receive gets the
// bytes, by IPC. The old receive used to stay posted and take the message.
func ipcWithdrawnRecv(ctx context.Context, r *rank, sys *gpu.System) error {
	want := pattern(70000, 43)
	ch, err := r.t.Channel(22, 1-r.id())
	if err != nil {
		return err
	}
	var req *transport.ChannelRequest
	var dst gpu.Buffer
	if r.id() == 1 {
		if dst, err = devWith(sys, make([]byte, len(want))); err != nil {
			return err
		}
		defer gpu.Free(dst)
		old, err := ch.Recv(dst)
		if err != nil {
			return err
		}
		if err := ch.Close(); err != nil {
			return err
		}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err = old.Wait(wctx)
		cancel()
		if !errors.Is(err, transport.ErrClosed) {
			return fmt.Errorf("receive pending when its channel closed: %v, want ErrClosed", err)
		}
		if ch, err = r.t.Channel(22, 0); err != nil {
			return fmt.Errorf("reopening channel 22: %w", err)
		}
		if req, err = ch.Recv(dst); err != nil {
			return err
		}
	}
	defer ch.Close()
	if err := r.b.Barrier(ctx, "gpuipc.withdraw"); err != nil {
		return err
	}
	if r.id() == 0 {
		src, err := devWith(sys, want)
		if err != nil {
			return err
		}
		defer gpu.Free(src)
		if req, err = ch.Send(src); err != nil {
			return err
		}
	}
	if err := req.Wait(ctx); err != nil {
		return fmt.Errorf("after a withdrawn receive: %w", err)
	}
	if r.id() == 1 {
		got := make([]byte, len(want))
		if err := gpu.CopyToHost(got, dst); err != nil {
			return err
		}
		if d := diff(got, want); d != "" || req.Path() != transport.PathIPC {
			return fmt.Errorf("after a withdrawn receive (path %s): %s", req.Path(), d)
		}
	}
	r.logf("ipc receive withdrawn by Close")
	return nil
}

// exchangeOne moves one n-byte device message and checks it.
func exchangeOne(ctx context.Context, ch *transport.Channel, sys *gpu.System, sending bool, n int) error {
	want := pattern(n, 77)
	if sending {
		src, err := devWith(sys, want)
		if err != nil {
			return err
		}
		defer gpu.Free(src)
		req, err := ch.Send(src)
		if err != nil {
			return err
		}
		return req.Wait(ctx)
	}
	dst, err := devWith(sys, make([]byte, n))
	if err != nil {
		return err
	}
	defer gpu.Free(dst)
	req, err := ch.Recv(dst)
	if err != nil {
		return err
	}
	if err := req.Wait(ctx); err != nil {
		return err
	}
	got := make([]byte, n)
	if err := gpu.CopyToHost(got, dst); err != nil {
		return err
	}
	if d := diff(got, want); d != "" {
		return errors.New(d)
	}
	return nil
}

// TestGPUChannelIPCPeerLost: a channel send waiting for a CUDA IPC
// acknowledgement, and a receive waiting for its control message, fail with
// the peer lost when the peer dies, instead of waiting for good.
func TestGPUChannelIPCPeerLost(t *testing.T) {
	useCUDA(t)
	requireRank1Killed(t, "gpuipcloss", "[0] rank 0: ipc send and recv failed with the peer lost")
}

// requireRank1Killed runs scenario role on two ranks over shared memory
// and requires rank 1 killed by SIGKILL, rank 0 done with line printed and
// no rank reporting a failure.
func requireRank1Killed(t *testing.T, role, line string) {
	t.Helper()
	res := launch(t, role, 2, cfg{"shm", "direct"})
	var rf *bootstrap.RankFailure
	if !errors.As(res.err, &rf) || rf.Rank != 1 || rf.Signal != syscall.SIGKILL {
		t.Fatalf("Launch returned %v, want rank 1 killed by SIGKILL:\n%s", res.err, res.dump())
	}
	requireLines(t, res, line, okLine(role, 0))
	if strings.Contains(res.stderr, "FAILED") {
		t.Fatalf("a rank reported a failure:\n%s", res.dump())
	}
}

// gpuIPCLoss is one rank of TestGPUChannelIPCPeerLost: after one message,
// rank 1 dies; rank 0 then sends and receives device memory on the channel.
func gpuIPCLoss(ctx context.Context, r *rank) error {
	r.skipFinalBarrier = true // rank 1 will not come
	sys, err := openGPU(r)
	if err != nil {
		return err
	}
	defer sys.Close()
	if !r.t.GPUIPCStats().Enabled {
		return fmt.Errorf("CUDA IPC off: %+v", r.t.GPUIPCStats())
	}
	ch, err := r.t.Channel(22, 1-r.id())
	if err != nil {
		return err
	}
	defer ch.Close()
	// One message by IPC first: the ranks are connected when rank 1 dies.
	if err := exchangeOne(ctx, ch, sys, r.id() == 0, 4096); err != nil {
		return fmt.Errorf("before the loss: %w", err)
	}
	if r.id() == 1 {
		if err := r.b.Barrier(ctx, "gpuipcloss.ready"); err != nil {
			return err
		}
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	// The launcher stops the survivor (SIGTERM) once rank 1 dies; it
	// finishes its checks first.
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	src, err := devWith(sys, pattern(4096, 1))
	if err != nil {
		return err
	}
	defer gpu.Free(src)
	dst, err := devWith(sys, make([]byte, 4096))
	if err != nil {
		return err
	}
	defer gpu.Free(dst)
	if err := r.b.Barrier(ctx, "gpuipcloss.ready"); err != nil {
		return err
	}
	sreq, err := ch.Send(src)
	if err != nil {
		return err
	}
	rreq, err := ch.Recv(dst)
	if err != nil {
		return err
	}
	for _, q := range []*transport.ChannelRequest{sreq, rreq} {
		err := q.Wait(ctx)
		var lost *transport.PeerLostError
		if !errors.As(err, &lost) {
			return fmt.Errorf("%s: got %v, want a *PeerLostError", q.Path(), err)
		}
		r.logf("lost: %v", err)
	}
	r.logf("ipc send and recv failed with the peer lost")
	return nil
}
