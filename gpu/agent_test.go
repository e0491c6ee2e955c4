package gpu

import (
	"bytes"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// warmAgent forces the system's copy agents on and copies until the device's
// agent has done a copy (the first eligible copy launches it and goes to
// the engine).
func warmAgent(t testing.TB, s *System, dst, src Buffer) {
	t.Helper()
	s.agentOn = true
	before := s.AgentStats().Copies
	deadline := time.Now().Add(30 * time.Second)
	for s.AgentStats().Copies == before {
		require.NoError(t, Copy(dst, src))
		require.True(t, time.Now().Before(deadline), "copy agent never started: %+v", s.AgentStats())
	}
}

// testCopyAgent: on the cuda backend, small copies between device and
// pinned memory go through the copy agent and land exactly (aligned and
// not, every direction, up to each direction's limit), the rest goes to the
// engine, an agent that returned when idle is relaunched, a job posted to
// an agent that is returning is withdrawn and copied by the engine, and
// Close stops a running agent. On the host backend the agent never runs.
func testCopyAgent(t *testing.T, s *System) {
	d := dev0(t, s)
	const size = 40 << 10
	d1, err := d.Alloc(size)
	require.NoError(t, err)
	d2, err := d.Alloc(size)
	require.NoError(t, err)
	h, err := s.AllocHost(size)
	require.NoError(t, err)
	if s.Backend() != BackendCUDA {
		require.False(t, agentWanted(s.Backend()))
		require.NoError(t, Copy(d1, h))
		require.Equal(t, AgentStats{}, s.AgentStats())
		return
	}
	sl := func(b Buffer, off, n int) Buffer {
		x, err := b.Slice(off, n)
		require.NoError(t, err)
		return x
	}
	// Enabled at open, the agent is set up there (its module loaded) but
	// not launched.
	t.Setenv(EnvGPUAgent, "on")
	s2, err := OpenBackend(BackendCUDA)
	require.NoError(t, err)
	require.True(t, s2.AgentStats().Enabled)
	require.True(t, s2.devices[0].agent.started, "agent set up when the system opened")
	require.Zero(t, s2.AgentStats().Launches)
	require.NoError(t, s2.Close())

	// Resident through the size loop (no idle return however slow the
	// machine), so that every eligible copy below must be the agent's.
	idle := s.agentIdle
	s.agentIdle = time.Minute
	warmAgent(t, s, sl(d1, 0, 8), sl(h, 0, 8))

	pattern := func(n, seed int) []byte {
		p := make([]byte, n)
		for i := range p {
			p[i] = byte(i*13 + seed)
		}
		return p
	}
	hb, err := h.Bytes()
	require.NoError(t, err)
	seed := 0
	for _, n := range []int{1, 7, 8, 64, 1000, agentMaxFromHost, agentMaxFromHost + 8, agentMaxToHost, agentMaxToHost + 1} {
		for _, off := range []int{0, 3} {
			for _, dir := range []string{"DtoH", "HtoD", "DtoD"} {
				seed++
				want := pattern(n, seed)
				var dst, src Buffer
				var limit int
				switch dir {
				case "DtoH":
					require.NoError(t, CopyFromHost(sl(d1, off, n), want))
					dst, src, limit = sl(h, off, n), sl(d1, off, n), agentMaxToHost
				case "HtoD":
					copy(hb[off:], want)
					dst, src, limit = sl(d2, off, n), sl(h, off, n), agentMaxFromHost
				case "DtoD":
					require.NoError(t, CopyFromHost(sl(d1, off, n), want))
					dst, src, limit = sl(d2, off, n), sl(d1, off, n), agentMaxOnDevice
				}
				before := s.AgentStats()
				require.NoError(t, Copy(dst, src))
				after := s.AgentStats()
				got := make([]byte, n)
				require.NoError(t, CopyToHost(got, dst))
				require.True(t, bytes.Equal(got, want), "%s %d bytes at +%d", dir, n, off)
				name := fmt.Sprintf("%s %d bytes", dir, n)
				if n > limit {
					require.Equal(t, before.Copies, after.Copies, name+": the engine's")
					require.Equal(t, before.Engine, after.Engine, name+": not eligible")
				} else {
					require.Equal(t, before.Copies+1, after.Copies, name+": the agent's")
				}
			}
		}
	}
	st := s.AgentStats()
	require.Zero(t, st.Failures)
	require.Greater(t, st.Copies, uint64(len([]string{"DtoH", "HtoD", "DtoD"}))) // more than the warm-ups

	// Idle: an agent launched with a short idle time returns by itself (its
	// stream drains), and the next copy relaunches it.
	ag := &d.agent
	ag.quiesce()
	s.agentIdle = idle
	warmAgent(t, s, sl(d1, 0, 8), sl(h, 0, 8))
	require.NoError(t, ag.st.Synchronize())
	require.Zero(t, atomic.LoadUint64(&ag.ctl[ctlAlive]), "an agent that returned clears its alive word")
	launches := s.AgentStats().Launches
	warmAgent(t, s, sl(d1, 0, 8), sl(h, 0, 8))
	require.Greater(t, s.AgentStats().Launches, launches)

	// A job posted to an agent that is returning is withdrawn: stop the
	// agent, then post under the lock as Copy would.
	ag.mu.Lock()
	atomic.StoreUint64(&ag.ctl[ctlStop], 1)
	require.NoError(t, ag.st.Synchronize())
	revoked := s.AgentStats().Revoked
	copy(hb, "revoked!")
	done, err := ag.copyLocked(sl(d1, 0, 8), sl(h, 0, 8))
	require.NoError(t, err)
	require.False(t, done)
	require.Equal(t, revoked+1, s.AgentStats().Revoked)
	require.Equal(t, ag.seq, atomic.LoadUint64(&ag.ctl[ctlDone]))
	atomic.StoreUint64(&ag.ctl[ctlStop], 0)
	ag.mu.Unlock()
	// The next agent starts after the withdrawn job and copies again.
	warmAgent(t, s, sl(d2, 0, 8), sl(h, 0, 8))
	got := make([]byte, 8)
	require.NoError(t, CopyToHost(got, sl(d2, 0, 8)))
	require.Equal(t, "revoked!", string(got))

	t.Logf("agent stats %+v", s.AgentStats())
	// Close stops the running agent.
	require.NoError(t, s.Close())
	require.ErrorIs(t, ag.broken, ErrClosed)
}

// testCopyAgentResident: while an agent is resident (a long idle time),
// every other operation of the device still returns promptly: freeing
// memory makes the agent return first (the driver would wait for it), and
// the next copies relaunch it.
func testCopyAgentResident(t *testing.T, s *System) {
	if s.Backend() != BackendCUDA {
		t.Skip("copy agents run on the cuda backend only")
	}
	d := dev0(t, s)
	s.agentIdle = time.Minute
	dbuf, err := d.Alloc(64)
	require.NoError(t, err)
	h, err := s.AllocHost(64)
	require.NoError(t, err)
	warmAgent(t, s, h, dbuf)
	st, err := d.NewStream()
	require.NoError(t, err)
	ipcBuf, err := d.Alloc(1 << 20)
	require.NoError(t, err)
	ops := []struct {
		name string
		fn   func() error
	}{
		{"Alloc+Free", func() error {
			b, err := d.Alloc(1 << 20)
			if err != nil {
				return err
			}
			return Free(b)
		}},
		{"AllocHost+Free", func() error {
			b, err := s.AllocHost(1 << 20)
			if err != nil {
				return err
			}
			return Free(b)
		}},
		{"CopyFromHost", func() error { return CopyFromHost(dbuf, make([]byte, 64)) }},
		{"CopyToHost", func() error { return CopyToHost(make([]byte, 64), dbuf) }},
		{"Memset", func() error { return Memset(dbuf, 7) }},
		{"CopyAsync+Synchronize", func() error {
			if err := CopyAsync(st, h, dbuf); err != nil {
				return err
			}
			return st.Synchronize()
		}},
		{"NewStream+Destroy", func() error {
			x, err := d.NewStream()
			if err != nil {
				return err
			}
			return x.Destroy()
		}},
		{"IPCGetHandle", func() error {
			_, err := s.IPCGetHandle(ipcBuf)
			return err
		}},
		{"LoadModule+Unload", func() error {
			m, err := d.LoadModule(agentPTX)
			if err != nil {
				return err
			}
			return m.Unload()
		}},
		{"NewEvent+Destroy", func() error {
			e, err := d.NewEvent()
			if err != nil {
				return err
			}
			return e.Destroy()
		}},
	}
	for _, op := range ops {
		warmAgent(t, s, h, dbuf)
		quiesced := s.AgentStats().Quiesced
		start := time.Now()
		require.NoError(t, op.fn(), op.name)
		took := time.Since(start)
		t.Logf("%s with the agent resident: %v (agents made to return: %d)", op.name, took, s.AgentStats().Quiesced-quiesced)
		require.Less(t, took, 10*time.Second, "%s waited for the resident agent", op.name)
		if strings.HasSuffix(op.name, "+Free") || strings.HasSuffix(op.name, "+Unload") {
			require.Greater(t, s.AgentStats().Quiesced, quiesced, "%s: the agent returns before memory is freed", op.name)
		}
	}
	require.NoError(t, st.Destroy())
	require.NoError(t, Free(ipcBuf))
	require.NoError(t, Free(dbuf))
	require.NoError(t, Free(h))
	require.Zero(t, s.AgentStats().Failures)
}

// testAllocHostZeroed: pinned memory comes zeroed, also when the driver
// hands out memory the process freed before (it does: the suite's stream
// waits on pinned gates passed at once on an H100 until AllocHost cleared).
func testAllocHostZeroed(t *testing.T, s *System) {
	for i := 0; i < 8; i++ {
		b, err := s.AllocHost(64 << i)
		require.NoError(t, err)
		bs, err := b.Bytes()
		require.NoError(t, err)
		for j, v := range bs {
			if v != 0 {
				t.Fatalf("allocation %d: byte %d is %#x", i, j, v)
			}
		}
		for j := range bs {
			bs[j] = 0xff
		}
		require.NoError(t, Free(b))
	}
}
