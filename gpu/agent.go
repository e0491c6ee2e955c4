package gpu

import (
	_ "embed"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// The copy agent. On the cuda backend every copy-engine operation costs
// 6-11 µs with its synchronize, even for 8 bytes (docs/gpu.md). A copy
// agent is one block of a kernel that stays resident on the device and
// polls a control block in pinned host memory; asked to copy, its threads
// move the bytes themselves, so a small synchronous copy costs the
// device's reads and writes across PCIe: 4-5 µs on an H100 for 8 B to 2
// KiB, against 7-11. Copy uses it for small copies between device and
// pinned memory of one device; everything else, and every copy while the
// agent is not running, goes to the copy engine as before.
//
// The agent returns after agentIdle (TROUPE_GPU_AGENT_IDLE) without work,
// so an idle rank leaves no kernel spinning, and before memory is freed
// (cuMemFree and its kind wait for every kernel of the device, the agent
// included); the next eligible copy goes to the copy engine and
// relaunches it. A resident kernel keeps a whole context busy, which
// several processes sharing a GPU without MPS would pay for in time
// slices: by default (TROUPE_GPU_AGENT=auto) the agent runs only when an
// MPS control daemon is found; on forces it, off disables it.

// EnvGPUAgent selects the copy agent: auto (default), on or off.
const EnvGPUAgent = "TROUPE_GPU_AGENT"

// EnvGPUAgentIdle sets how long an agent without work stays resident (a Go
// duration; default 10ms).
const EnvGPUAgentIdle = "TROUPE_GPU_AGENT_IDLE"

//go:embed agent.ptx
var agentPTX []byte

const (
	agentThreads = 128
	agentIdle    = 10 * time.Millisecond
	// agentDeadline bounds one copy; past it the agent is given up.
	agentDeadline = time.Second
	agentLow48    = 1<<48 - 1
)

// Largest copy the agent takes, per direction, from BenchmarkAgentCopy on
// an H100 with MPS (µs per synchronous copy, agent against engine): to host
// 3.8/7.7 at 2 KiB, 4.9/7.1 at 8 KiB, 6.3/7.2 at 16 KiB; from host 6.5/7.5
// at 2 KiB but 9.3/8.1 at 4 KiB (its reads of host memory cross PCIe one
// round trip per load); on the device 3.8/11.2 at 2 KiB, 6.2/11.7 at 16
// KiB.
const (
	agentMaxToHost   = 16 << 10
	agentMaxFromHost = 2 << 10
	agentMaxOnDevice = 16 << 10
)

// Control block words (agent.cu).
const (
	ctlDst   = 0
	ctlSrc   = 1
	ctlLen   = 2
	ctlStop  = 3
	ctlDone  = 8
	ctlAlive = 16
	ctlWords = 24
)

// AgentStats counts a system's copy agent work.
type AgentStats struct {
	Enabled  bool   // the agent may run (TROUPE_GPU_AGENT and the backend)
	Copies   uint64 // copies done by an agent
	Engine   uint64 // eligible copies that went to the copy engine (agent not running or busy)
	Launches uint64 // agent kernel launches
	Revoked  uint64 // copies posted to an agent that was returning, then done by the engine
	Quiesced uint64 // agents made to return before freeing memory (the driver waits for every kernel)
	Failures uint64 // agents given up (launch failed or a copy passed its deadline)
}

// copyAgent is the copy agent of one device.
type copyAgent struct {
	dev *Device

	mu      sync.Mutex
	started bool // module, stream and control block set up
	broken  error
	fn      *Function
	mod     *Module
	st      *Stream
	ctlBuf  Buffer
	ctl     []uint64
	gen     uint64 // generation of the latest launch
	seq     uint64 // number of the latest job
}

// agentStats are the counters of every agent of a system.
type agentStats struct {
	copies, engine, launches, revoked, quiesced, failures atomic.Uint64
}

// agentWanted reports whether this process may run copy agents.
func agentWanted(backend string) bool {
	if backend != BackendCUDA {
		return false
	}
	switch strings.ToLower(os.Getenv(EnvGPUAgent)) {
	case "on", "1", "yes", "true":
		return true
	case "off", "0", "no", "false":
		return false
	}
	return mpsRunning()
}

// agentIdleTime returns TROUPE_GPU_AGENT_IDLE, or the default when it is
// unset or not a positive duration.
func agentIdleTime() time.Duration {
	if d, err := time.ParseDuration(os.Getenv(EnvGPUAgentIdle)); err == nil && d > 0 {
		return d
	}
	return agentIdle
}

// mpsRunning reports whether an MPS control daemon's pipe is present.
func mpsRunning() bool {
	dir := os.Getenv("CUDA_MPS_PIPE_DIRECTORY")
	if dir == "" {
		dir = "/tmp/nvidia-mps"
	}
	_, err := os.Stat(filepath.Join(dir, "control"))
	return err == nil
}

// AgentStats returns the counters of the system's copy agents.
func (s *System) AgentStats() AgentStats {
	return AgentStats{
		Enabled:  s.agentOn,
		Copies:   s.agentStats.copies.Load(),
		Engine:   s.agentStats.engine.Load(),
		Launches: s.agentStats.launches.Load(),
		Revoked:  s.agentStats.revoked.Load(),
		Quiesced: s.agentStats.quiesced.Load(),
		Failures: s.agentStats.failures.Load(),
	}
}

// AgentCopy copies src into dst by the copy agent of their device when
// Copy would (a small copy between device and pinned memory of one device,
// the agent enabled and running) and reports whether it did; err is then
// the copy's result. Otherwise it copies nothing, so the caller can copy
// its own way (on a stream, say). Like Copy it returns when the bytes have
// landed and is not ordered with any stream.
func AgentCopy(dst, src Buffer) (bool, error) {
	if err := checkPair(dst, src); err != nil {
		return false, err
	}
	if dst.n == 0 {
		return true, nil
	}
	return agentCopy(dst, src)
}

// AgentReady reports whether AgentCopy would copy src into dst now: Copy's
// conditions hold and the device's agent is resident and idle. It launches
// nothing; a copy racing with another may still find the agent busy.
func AgentReady(dst, src Buffer) bool {
	if checkPair(dst, src) != nil || !dst.a.sys.agentOn {
		return false
	}
	dev := agentFor(dst, src)
	if dev == nil {
		return false
	}
	ag := &dev.agent
	if !ag.mu.TryLock() {
		return false
	}
	defer ag.mu.Unlock()
	return ag.broken == nil && ag.residentLocked()
}

// agentFor returns the device whose agent may copy src into dst, or nil:
// device and pinned memory only (pageable Go memory is not mapped for the
// device, managed memory would migrate), one device, within the
// direction's size limit, addresses below 2^48.
func agentFor(dst, src Buffer) *Device {
	n := dst.n
	var dev *Device
	var max int
	switch dk, sk := dst.Kind(), src.Kind(); {
	case dk == KindPinned && sk == KindDevice:
		dev, max = src.Device(), agentMaxToHost
	case dk == KindDevice && sk == KindPinned:
		dev, max = dst.Device(), agentMaxFromHost
	case dk == KindDevice && sk == KindDevice && dst.Device() == src.Device():
		dev, max = dst.Device(), agentMaxOnDevice
	default:
		return nil
	}
	if dev == nil || n > max || uint64(dst.ptr)|uint64(src.ptr)|uint64(n) > agentLow48 {
		return nil
	}
	return dev
}

// agentCopy copies src into dst by the device's agent when it can. done
// reports whether it did (err is then the copy's result); otherwise the
// caller copies by the engine.
func agentCopy(dst, src Buffer) (done bool, err error) {
	sys := dst.a.sys
	if !sys.agentOn {
		return false, nil
	}
	dev := agentFor(dst, src)
	if dev == nil {
		return false, nil
	}
	ag := &dev.agent
	if !ag.mu.TryLock() {
		sys.agentStats.engine.Add(1)
		return false, nil
	}
	defer ag.mu.Unlock()
	if !ag.runningLocked() {
		sys.agentStats.engine.Add(1)
		return false, nil
	}
	return ag.copyLocked(dst, src)
}

// runningLocked reports whether the agent is running, launching it
// (without waiting) when it is not.
func (ag *copyAgent) runningLocked() bool {
	if ag.broken != nil {
		return false
	}
	if ag.residentLocked() {
		return true
	}
	if err := ag.launchLocked(); err != nil {
		ag.giveUpLocked(err)
	}
	return false
}

// residentLocked reports whether the latest launch is running.
func (ag *copyAgent) residentLocked() bool {
	return ag.started && ag.gen > 0 && atomic.LoadUint64(&ag.ctl[ctlAlive]) == ag.gen
}

// prepare sets the agent up when its system opens (without launching it).
// Loading a module waits for all of the device's work, so it must not
// happen later from a copy that a stream may be waiting for (a queue's
// agent copying while the queue's stream waits on a counter the host
// writes after the copy: seen on an H100 with Faces). A failure leaves the
// agent off.
func (ag *copyAgent) prepare() {
	ag.mu.Lock()
	defer ag.mu.Unlock()
	if err := ag.setupLocked(); err != nil {
		ag.giveUpLocked(err)
	}
}

// setupLocked loads the agent's module and allocates its stream and control
// block, once.
func (ag *copyAgent) setupLocked() error {
	if ag.started {
		return nil
	}
	sys := ag.dev.sys
	mod, err := ag.dev.loadModule(agentPTX) // the agent is not running
	if err != nil {
		return err
	}
	fn, err := mod.Function("troupe_copy_agent")
	if err != nil {
		mod.unload(false)
		return err
	}
	st, err := ag.dev.NewStream()
	if err != nil {
		mod.unload(false)
		return err
	}
	ctlBuf, err := sys.AllocHost(ctlWords * 8)
	if err != nil {
		st.Destroy()
		mod.unload(false)
		return err
	}
	b, _ := ctlBuf.Bytes() // zeroed by AllocHost
	ag.mod, ag.fn, ag.st, ag.ctlBuf = mod, fn, st, ctlBuf
	ag.ctl = unsafe.Slice((*uint64)(unsafe.Pointer(&b[0])), ctlWords)
	ag.started = true
	return nil
}

// launchLocked sets the agent up if its system did not (agents enabled
// after opening: tests), and launches a new generation unless the last one
// is still starting.
func (ag *copyAgent) launchLocked() error {
	sys := ag.dev.sys
	if !ag.started {
		if err := ag.setupLocked(); err != nil {
			return err
		}
	} else if idle, err := ag.st.Query(); err != nil {
		return err
	} else if !idle {
		return nil // the launched generation has not started yet, or is returning
	}
	ag.gen++
	sys.agentStats.launches.Add(1)
	return Launch(ag.st, ag.fn, Dim3{X: 1}, Dim3{X: agentThreads},
		uint64(ag.ctlBuf.ptr), uint64(sys.agentIdle), ag.gen)
}

// copyLocked posts one job to the running agent and waits for it.
func (ag *copyAgent) copyLocked(dst, src Buffer) (bool, error) {
	sys := ag.dev.sys
	ag.seq++
	tag := (ag.seq%0xffff + 1) << 48
	ctl := ag.ctl
	atomic.StoreUint64(&ctl[ctlDst], uint64(dst.ptr)|tag)
	atomic.StoreUint64(&ctl[ctlSrc], uint64(src.ptr)|tag)
	atomic.StoreUint64(&ctl[ctlLen], uint64(dst.n)|tag)
	var deadline time.Time
	for i := 0; ; i++ {
		if atomic.LoadUint64(&ctl[ctlDone]) == ag.seq {
			sys.agentStats.copies.Add(1)
			return true, nil
		}
		if atomic.LoadUint64(&ctl[ctlAlive]) != ag.gen {
			// The agent decided to return before it saw the job (it
			// clears ctlAlive only then) and will not take it: withdraw
			// the job and let the engine copy.
			if atomic.LoadUint64(&ctl[ctlDone]) == ag.seq {
				continue
			}
			atomic.StoreUint64(&ctl[ctlDst], 0)
			atomic.StoreUint64(&ctl[ctlSrc], 0)
			atomic.StoreUint64(&ctl[ctlLen], 0)
			atomic.StoreUint64(&ctl[ctlDone], ag.seq)
			sys.agentStats.revoked.Add(1)
			return false, nil
		}
		if i&1023 == 1023 {
			now := time.Now()
			if deadline.IsZero() {
				deadline = now.Add(agentDeadline)
			} else if now.After(deadline) {
				err := fmt.Errorf("gpu: copy agent on %v: a %d-byte copy did not finish in %v", ag.dev, dst.n, agentDeadline)
				ag.giveUpLocked(err)
				return true, err
			}
		}
	}
}

// giveUpLocked stops using the agent for good.
func (ag *copyAgent) giveUpLocked(err error) {
	ag.broken = err
	ag.dev.sys.agentStats.failures.Add(1)
}

// quiesceAgents makes the system's running copy agents return before a
// driver call that waits for all of a device's work (cuMemFree,
// cuMemFreeHost, cuIpcCloseMemHandle): with an agent resident it would wait
// until the agent's idle time ran out. The next eligible copy relaunches
// the agent.
func (s *System) quiesceAgents() {
	if !s.agentOn {
		return
	}
	for _, d := range s.devices {
		d.agent.quiesce()
	}
}

// quiesce makes the agent return if it runs, and waits for it: a few µs,
// as it polls its control block all the time.
func (ag *copyAgent) quiesce() {
	ag.mu.Lock()
	defer ag.mu.Unlock()
	if !ag.started || ag.broken != nil {
		return
	}
	if idle, err := ag.st.impl.query(); err == nil && idle {
		return
	}
	atomic.StoreUint64(&ag.ctl[ctlStop], 1)
	err := ag.st.impl.synchronize()
	atomic.StoreUint64(&ag.ctl[ctlStop], 0)
	ag.dev.sys.agentStats.quiesced.Add(1)
	if err != nil {
		ag.giveUpLocked(err)
	}
}

// stop asks a running agent to return and waits for it (System.Close).
func (ag *copyAgent) stop() error {
	ag.mu.Lock()
	defer ag.mu.Unlock()
	if !ag.started {
		return nil
	}
	ag.broken = errors.Join(ag.broken, ErrClosed)
	atomic.StoreUint64(&ag.ctl[ctlStop], 1)
	// The system is already closed to callers: use the backend directly.
	err := ag.st.impl.synchronize()
	if ag.mod.unloaded.CompareAndSwap(false, true) {
		err = errors.Join(err, ag.mod.impl.unload())
	}
	ag.started = false
	return err
}
