package gpu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// backendCase opens one backend for the shared suite, or skips.
type backendCase struct {
	name string
	open func(t *testing.T) *System
}

func openOrSkip(name string) func(t *testing.T) *System {
	return func(t *testing.T) *System {
		t.Helper()
		if name == BackendCUDA {
			skipWithoutCUDA(t)
		}
		s, err := OpenBackend(name)
		require.NoError(t, err)
		t.Cleanup(func() { assert.NoError(t, s.Close()) })
		return s
	}
}

// skipWithoutCUDA skips when the cuda backend is unusable, or fails when
// TROUPE_GPU=cuda asks for it.
func skipWithoutCUDA(t *testing.T) {
	t.Helper()
	if err := CUDAAvailable(); err != nil {
		if strings.EqualFold(os.Getenv(EnvBackend), BackendCUDA) {
			t.Fatalf("%s=cuda but the cuda backend is unavailable: %v", EnvBackend, err)
		}
		t.Skipf("cuda backend skipped: no CUDA driver/device: %v", err)
	}
}

var backendCases = []backendCase{
	{BackendHost, openOrSkip(BackendHost)},
	{BackendCUDA, openOrSkip(BackendCUDA)},
}

// TestSuite runs the same tests against every backend; the cuda run is
// skipped with the reason when there is no driver or device.
func TestSuite(t *testing.T) {
	for _, bc := range backendCases {
		t.Run(bc.name, func(t *testing.T) {
			if bc.name == BackendCUDA {
				skipWithoutCUDA(t)
			}
			for _, tc := range suiteTests {
				t.Run(tc.name, func(t *testing.T) {
					s := bc.open(t)
					require.Equal(t, bc.name, s.Backend())
					tc.fn(t, s)
				})
			}
		})
	}
}

var suiteTests = []struct {
	name string
	fn   func(t *testing.T, s *System)
}{
	{"Devices", testDevices},
	{"CopySyncAllKinds", testCopySyncAllKinds},
	{"CopyAsyncAllKinds", testCopyAsyncAllKinds},
	{"StreamOrdering", testStreamOrdering},
	{"Events", testEvents},
	{"WaitValueAcrossStreams", testWaitValueAcrossStreams},
	{"WaitValueConditions", testWaitValueConditions},
	{"HostValueOps", testHostValueOps},
	{"StreamValueOpsRefuseManaged", testStreamValueOpsRefuseManaged},
	{"Memset", testMemset},
	{"Bounds", testBounds},
	{"UseAfterFree", testUseAfterFree},
	{"KindOfCache", testKindOfCache},
	{"BufferAt", testBufferAt},
	{"PinnedPool", testPinnedPool},
	{"IPC", testIPC},
	{"LaunchHost", testLaunchHost},
	{"Modules", testModules},
	{"CopyAgent", testCopyAgent},
	{"CopyAgentResident", testCopyAgentResident},
	{"AllocHostZeroed", testAllocHostZeroed},
}

func dev0(t *testing.T, s *System) *Device {
	d, err := s.Device(0)
	require.NoError(t, err)
	return d
}

func pattern(n int, seed byte) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(i*7) + seed
	}
	return p
}

func testDevices(t *testing.T, s *System) {
	devs := s.Devices()
	require.NotEmpty(t, devs)
	for i, d := range devs {
		assert.Equal(t, i, d.Ordinal())
		assert.Equal(t, s.Backend(), d.Backend())
		assert.NotEmpty(t, d.Name())
		assert.Same(t, s, d.System())
		free, total, err := d.MemInfo()
		require.NoError(t, err)
		assert.Positive(t, total)
		assert.LessOrEqual(t, free, total)
	}
	_, err := s.Device(len(devs))
	assert.ErrorIs(t, err, ErrOutOfBounds)
}

// allocKind returns an n-byte buffer of kind k.
func allocKind(t *testing.T, s *System, k Kind, n int) Buffer {
	t.Helper()
	var b Buffer
	var err error
	switch k {
	case KindHost:
		b = s.HostBuffer(make([]byte, n))
	case KindPinned:
		b, err = s.AllocHost(n)
	case KindDevice:
		b, err = dev0(t, s).Alloc(n)
	case KindManaged:
		b, err = dev0(t, s).AllocManaged(n)
		if errors.Is(err, ErrNotSupported) {
			t.Skip("managed memory not supported")
		}
	}
	require.NoError(t, err)
	require.Equal(t, k, b.Kind())
	require.Equal(t, n, b.Len())
	if k != KindHost {
		t.Cleanup(func() { _ = Free(b) })
	}
	return b
}

var allKinds = []Kind{KindHost, KindPinned, KindDevice, KindManaged}

func testCopySyncAllKinds(t *testing.T, s *System) {
	const n = 3000
	for _, from := range allKinds {
		for _, to := range allKinds {
			t.Run(from.String()+"->"+to.String(), func(t *testing.T) {
				src := allocKind(t, s, from, n)
				dst := allocKind(t, s, to, n)
				want := pattern(n, byte(from)*16+byte(to))
				require.NoError(t, CopyFromHost(src, want))
				require.NoError(t, Copy(dst, src))
				got := make([]byte, n)
				require.NoError(t, CopyToHost(got, dst))
				assert.Equal(t, want, got)
			})
		}
	}
}

func testCopyAsyncAllKinds(t *testing.T, s *System) {
	const n = 5000
	st, err := dev0(t, s).NewStream()
	require.NoError(t, err)
	defer st.Destroy()
	for _, from := range allKinds {
		for _, to := range allKinds {
			t.Run(from.String()+"->"+to.String(), func(t *testing.T) {
				src := allocKind(t, s, from, n)
				dst := allocKind(t, s, to, n)
				stage := allocKind(t, s, KindPinned, n)
				want := pattern(n, byte(from)*3+byte(to))
				host, err := stage.Bytes()
				require.NoError(t, err)
				copy(host, want)
				require.NoError(t, CopyAsync(st, src, stage))
				// Slices: copy the two halves separately.
				h := n / 2
				a1, _ := dst.Slice(0, h)
				b1, _ := src.Slice(0, h)
				a2, _ := dst.Slice(h, n-h)
				b2, _ := src.Slice(h, n-h)
				require.NoError(t, CopyAsync(st, a2, b2))
				require.NoError(t, CopyAsync(st, a1, b1))
				require.NoError(t, st.Synchronize())
				got := make([]byte, n)
				require.NoError(t, CopyToHost(got, dst))
				assert.Equal(t, want, got)
			})
		}
	}
}

// testStreamOrdering enqueues many dependent operations; each reads what the
// previous one wrote, so any reordering shows in the result.
func testStreamOrdering(t *testing.T, s *System) {
	const rounds = 300
	d := dev0(t, s)
	st, err := d.NewStream()
	require.NoError(t, err)
	defer st.Destroy()
	word := allocKind(t, s, KindDevice, 8)
	tmp := allocKind(t, s, KindDevice, 8)
	out := allocKind(t, s, KindPinned, 8*rounds)
	for i := range rounds {
		require.NoError(t, WriteValue64(st, word, uint64(i+1)))
		require.NoError(t, CopyAsync(st, tmp, word))
		slot, err := out.Slice(8*i, 8)
		require.NoError(t, err)
		require.NoError(t, CopyAsync(st, slot, tmp))
		require.NoError(t, MemsetAsync(st, tmp, 0xff))
	}
	require.NoError(t, st.Synchronize())
	done, err := st.Query()
	require.NoError(t, err)
	assert.True(t, done)
	for i := range rounds {
		slot, _ := out.Slice(8*i, 8)
		v, err := ReadValue64(slot)
		require.NoError(t, err)
		require.Equal(t, uint64(i+1), v, "slot %d", i)
	}
	v, err := ReadValue64(tmp)
	require.NoError(t, err)
	assert.Equal(t, ^uint64(0), v)
}

// eventually polls cond (tests only).
func eventually(t *testing.T, cond func() bool, msg string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out: %s", msg)
		}
		time.Sleep(time.Millisecond)
	}
}

func testEvents(t *testing.T, s *System) {
	d := dev0(t, s)
	a, err := d.NewStream()
	require.NoError(t, err)
	defer a.Destroy()
	b, err := d.NewStream()
	require.NoError(t, err)
	defer b.Destroy()
	ev, err := d.NewEvent()
	require.NoError(t, err)
	defer ev.Destroy()

	// Never recorded: complete.
	done, err := ev.Query()
	require.NoError(t, err)
	assert.True(t, done)
	require.NoError(t, ev.Synchronize())

	gate := allocKind(t, s, KindPinned, 8)
	data := allocKind(t, s, KindDevice, 64)
	out := allocKind(t, s, KindPinned, 64)

	// a: wait for the gate, fill data, record ev.
	require.NoError(t, WaitValue64(a, gate, 1, GEQ))
	require.NoError(t, MemsetAsync(a, data, 0x5a))
	require.NoError(t, ev.Record(a))
	// b: wait for ev, copy data out.
	require.NoError(t, b.WaitEvent(ev))
	require.NoError(t, CopyAsync(b, out, data))

	time.Sleep(20 * time.Millisecond)
	done, err = ev.Query()
	require.NoError(t, err)
	assert.False(t, done, "event completed before its stream's gate opened")
	done, err = b.Query()
	require.NoError(t, err)
	assert.False(t, done, "stream b ran past WaitEvent")

	require.NoError(t, WriteValue64Host(gate, 1))
	require.NoError(t, ev.Synchronize())
	require.NoError(t, b.Synchronize())
	done, err = ev.Query()
	require.NoError(t, err)
	assert.True(t, done)
	got, _ := out.Bytes()
	assert.Equal(t, bytes.Repeat([]byte{0x5a}, 64), got)

	// Re-recording moves the event to the new point.
	require.NoError(t, WaitValue64(a, gate, 2, GEQ))
	require.NoError(t, ev.Record(a))
	done, _ = ev.Query()
	assert.False(t, done)
	require.NoError(t, WriteValue64Host(gate, 2))
	require.NoError(t, ev.Synchronize())
}

// testWaitValueAcrossStreams: stream B waits for a value that stream A
// writes later; enqueueing never blocks the host.
func testWaitValueAcrossStreams(t *testing.T, s *System) {
	d := dev0(t, s)
	a, err := d.NewStream()
	require.NoError(t, err)
	defer a.Destroy()
	b, err := d.NewStream()
	require.NoError(t, err)
	defer b.Destroy()
	for _, flagKind := range []Kind{KindPinned, KindDevice} {
		t.Run("flag="+flagKind.String(), func(t *testing.T) {
			const n = 4096
			flag := allocKind(t, s, flagKind, 8)
			require.NoError(t, Memset(flag, 0))
			src := allocKind(t, s, KindDevice, n)
			dst := allocKind(t, s, KindDevice, n)
			out := allocKind(t, s, KindPinned, n)
			require.NoError(t, Memset(dst, 0))

			start := time.Now()
			require.NoError(t, WaitValue64(b, flag, 7, GEQ))
			require.NoError(t, CopyAsync(b, dst, src))
			require.NoError(t, CopyAsync(b, out, dst))
			assert.Less(t, time.Since(start), 2*time.Second, "enqueue blocked the host")

			time.Sleep(20 * time.Millisecond)
			done, err := b.Query()
			require.NoError(t, err)
			require.False(t, done, "stream B did not wait")

			stage := allocKind(t, s, KindPinned, n)
			p, _ := stage.Bytes()
			copy(p, pattern(n, 3))
			require.NoError(t, CopyAsync(a, src, stage))
			require.NoError(t, WriteValue64(a, flag, 7))
			require.NoError(t, b.Synchronize())
			require.NoError(t, a.Synchronize())
			got, _ := out.Bytes()
			assert.Equal(t, pattern(n, 3), got)
			v, err := ReadValue64(flag)
			require.NoError(t, err)
			assert.Equal(t, uint64(7), v)
		})
	}
}

func testWaitValueConditions(t *testing.T, s *System) {
	d := dev0(t, s)
	st, err := d.NewStream()
	require.NoError(t, err)
	defer st.Destroy()
	flag := allocKind(t, s, KindPinned, 8)
	marker := allocKind(t, s, KindPinned, 8)
	cases := []struct {
		cond        Cond
		cur, target uint64
		wake        uint64
	}{
		{GEQ, 0, 5, 9},
		{GEQ, ^uint64(0) - 1, 1, 2}, // wrap-around: (int64)(0-1) < 0, (int64)(2-1) >= 0
		{EQ, 4, 5, 5},
		{AND, 0x10, 0x3, 0x2},
		{NOR, ^uint64(0), 0xf0, 0x0f},
	}
	for i, c := range cases {
		t.Run(fmt.Sprintf("%v#%d", c.cond, i), func(t *testing.T) {
			require.NoError(t, WriteValue64Host(flag, c.cur))
			require.NoError(t, WriteValue64Host(marker, 0))
			require.NoError(t, WaitValue64(st, flag, c.target, c.cond))
			require.NoError(t, WriteValue64(st, marker, 1))
			time.Sleep(10 * time.Millisecond)
			m, err := ReadValue64(marker)
			require.NoError(t, err)
			require.Zero(t, m, "wait %v %#x vs %#x did not block", c.cond, c.cur, c.target)
			require.NoError(t, WriteValue64Host(flag, c.wake))
			require.NoError(t, st.Synchronize())
			m, _ = ReadValue64(marker)
			require.Equal(t, uint64(1), m)
		})
	}
	assert.Error(t, WaitValue64(st, flag, 1, Cond(42)))
}

func testHostValueOps(t *testing.T, s *System) {
	d := dev0(t, s)
	st, err := d.NewStream()
	require.NoError(t, err)
	defer st.Destroy()
	for _, k := range []Kind{KindPinned, KindDevice} {
		t.Run(k.String(), func(t *testing.T) {
			w := allocKind(t, s, k, 16)
			require.NoError(t, WriteValue64Host(w, 41))
			v, err := ReadValue64(w)
			require.NoError(t, err)
			assert.Equal(t, uint64(41), v)

			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
			err = WaitValue64Host(ctx, w, 42, GEQ)
			cancel()
			assert.ErrorIs(t, err, context.DeadlineExceeded)

			gate := allocKind(t, s, KindPinned, 8)
			require.NoError(t, WaitValue64(st, gate, 1, EQ))
			require.NoError(t, WriteValue64(st, w, 42))
			errc := make(chan error, 1)
			go func() { errc <- WaitValue64Host(context.Background(), w, 42, EQ) }()
			select {
			case err := <-errc:
				t.Fatalf("host wait returned early: %v", err)
			case <-time.After(10 * time.Millisecond):
			}
			require.NoError(t, WriteValue64Host(gate, 1))
			select {
			case err := <-errc:
				require.NoError(t, err)
			case <-time.After(10 * time.Second):
				t.Fatal("host wait never woke")
			}
			require.NoError(t, st.Synchronize())
		})
	}
}

func testMemset(t *testing.T, s *System) {
	d := dev0(t, s)
	st, err := d.NewStream()
	require.NoError(t, err)
	defer st.Destroy()
	for _, k := range allKinds {
		t.Run(k.String(), func(t *testing.T) {
			const n = 1000
			b := allocKind(t, s, k, n)
			require.NoError(t, Memset(b, 0xab))
			mid, _ := b.Slice(100, 50)
			if k == KindHost {
				assert.ErrorIs(t, MemsetAsync(st, mid, 1), ErrUnsupportedKind)
				require.NoError(t, Memset(mid, 0x11))
			} else {
				require.NoError(t, MemsetAsync(st, mid, 0x11))
				require.NoError(t, st.Synchronize())
			}
			got := make([]byte, n)
			require.NoError(t, CopyToHost(got, b))
			want := bytes.Repeat([]byte{0xab}, n)
			copy(want[100:150], bytes.Repeat([]byte{0x11}, 50))
			assert.Equal(t, want, got)
		})
	}
}

// testStreamValueOpsRefuseManaged: WriteValue64 and WaitValue64 refuse
// managed memory on every backend (CUDA's stream memory operations do not
// accept it); the host-side value operations still work on it.
func testStreamValueOpsRefuseManaged(t *testing.T, s *System) {
	st, err := dev0(t, s).NewStream()
	require.NoError(t, err)
	defer st.Destroy()
	m := allocKind(t, s, KindManaged, 16)
	assert.ErrorIs(t, WriteValue64(st, m, 1), ErrUnsupportedKind)
	assert.ErrorIs(t, WaitValue64(st, m, 1, GEQ), ErrUnsupportedKind)
	require.NoError(t, st.Synchronize())
	require.NoError(t, WriteValue64Host(m, 7))
	v, err := ReadValue64(m)
	require.NoError(t, err)
	assert.Equal(t, uint64(7), v)
	require.NoError(t, WaitValue64Host(context.Background(), m, 7, EQ))
}

func testBounds(t *testing.T, s *System) {
	d := dev0(t, s)
	b := allocKind(t, s, KindDevice, 100)
	for _, c := range [][2]int{{-1, 1}, {0, 101}, {50, 51}, {101, 0}, {0, -1}} {
		_, err := b.Slice(c[0], c[1])
		assert.ErrorIs(t, err, ErrOutOfBounds, "Slice(%d, %d)", c[0], c[1])
	}
	sl, err := b.Slice(100, 0)
	require.NoError(t, err)
	assert.Equal(t, 0, sl.Len())
	sl, err = b.Slice(10, 20)
	require.NoError(t, err)
	assert.Equal(t, b.Ptr()+10, sl.Ptr())
	assert.Equal(t, 10, sl.Offset())
	_, err = sl.Slice(5, 16)
	assert.ErrorIs(t, err, ErrOutOfBounds)

	other := allocKind(t, s, KindDevice, 99)
	assert.ErrorIs(t, Copy(b, other), ErrSizeMismatch)
	assert.ErrorIs(t, CopyToHost(make([]byte, 10), b), ErrSizeMismatch)
	st, err := d.NewStream()
	require.NoError(t, err)
	defer st.Destroy()
	assert.ErrorIs(t, CopyAsync(st, b, other), ErrSizeMismatch)

	small, _ := b.Slice(0, 4)
	assert.ErrorIs(t, WriteValue64(st, small, 1), ErrOutOfBounds)
	odd, _ := b.Slice(3, 8)
	assert.ErrorIs(t, WriteValue64(st, odd, 1), ErrMisaligned)
	assert.ErrorIs(t, WaitValue64(st, odd, 1, GEQ), ErrMisaligned)
	goMem := s.HostBuffer(make([]byte, 8))
	assert.ErrorIs(t, WriteValue64(st, goMem, 1), ErrUnsupportedKind)

	_, err = b.Bytes()
	assert.ErrorIs(t, err, ErrNotHostMemory)
	p := allocKind(t, s, KindPinned, 10)
	bs, err := p.Bytes()
	require.NoError(t, err)
	assert.Len(t, bs, 10)

	var zero Buffer
	assert.True(t, zero.IsZero())
	assert.ErrorIs(t, Copy(zero, zero), ErrZeroBuffer)
	_, err = zero.Slice(0, 0)
	assert.ErrorIs(t, err, ErrZeroBuffer)
	_, err = d.Alloc(0)
	assert.ErrorIs(t, err, ErrOutOfBounds)
}

func testUseAfterFree(t *testing.T, s *System) {
	d := dev0(t, s)
	st, err := d.NewStream()
	require.NoError(t, err)
	defer st.Destroy()
	b, err := d.Alloc(64)
	require.NoError(t, err)
	sl, _ := b.Slice(8, 8)
	assert.ErrorIs(t, Free(sl), ErrNotAllocation)
	require.NoError(t, Free(b))
	assert.True(t, b.Freed())
	assert.ErrorIs(t, Free(b), ErrFreed)
	assert.ErrorIs(t, Memset(b, 0), ErrFreed)
	assert.ErrorIs(t, MemsetAsync(st, sl, 0), ErrFreed)
	assert.ErrorIs(t, CopyToHost(make([]byte, 64), b), ErrFreed)
	assert.ErrorIs(t, WriteValue64(st, sl, 1), ErrFreed)
	_, err = ReadValue64(sl)
	assert.ErrorIs(t, err, ErrFreed)
	assert.ErrorIs(t, Free(s.HostBuffer(make([]byte, 8))), ErrNotAllocation)

	// Destroyed streams and events.
	st2, err := d.NewStream()
	require.NoError(t, err)
	require.NoError(t, st2.Destroy())
	assert.ErrorIs(t, st2.Synchronize(), ErrDestroyed)
	assert.ErrorIs(t, st2.Destroy(), ErrDestroyed)
	p := allocKind(t, s, KindPinned, 8)
	assert.ErrorIs(t, WriteValue64(st2, p, 1), ErrDestroyed)
	ev, err := d.NewEvent()
	require.NoError(t, err)
	require.NoError(t, ev.Destroy())
	assert.ErrorIs(t, ev.Record(st), ErrDestroyed)
}

func testKindOfCache(t *testing.T, s *System) {
	d := dev0(t, s)
	dv, err := d.Alloc(1 << 16)
	require.NoError(t, err)
	pn := allocKind(t, s, KindPinned, 4096)
	goMem := make([]byte, 64)

	k, kd := s.KindOf(dv.Ptr() + 100)
	assert.Equal(t, KindDevice, k)
	assert.Same(t, d, kd)
	h0, m0 := s.KindCacheStats()
	k, kd = s.KindOf(dv.Ptr() + 100)
	assert.Equal(t, KindDevice, k)
	assert.Same(t, d, kd)
	h1, m1 := s.KindCacheStats()
	assert.Equal(t, h0+1, h1, "second lookup should hit the cache")
	assert.Equal(t, m0, m1)

	k, kd = s.KindOf(pn.Ptr())
	assert.Equal(t, KindPinned, k)
	assert.Nil(t, kd)
	k, _ = s.KindOf(addrOf(goMem))
	assert.Equal(t, KindHost, k)

	_, m1 = s.KindCacheStats()
	require.NoError(t, Free(dv))
	k, kd = s.KindOf(dv.Ptr() + 100)
	assert.Equal(t, KindHost, k, "KindOf after Free must not report the stale kind")
	assert.Nil(t, kd)
	_, m2 := s.KindCacheStats()
	assert.Equal(t, m1+1, m2, "Free must invalidate the cached entry")
}

func testBufferAt(t *testing.T, s *System) {
	b := allocKind(t, s, KindDevice, 256)
	x, err := s.BufferAt(b.Ptr()+16, 32)
	require.NoError(t, err)
	assert.Equal(t, KindDevice, x.Kind())
	assert.Equal(t, 16, x.Offset())
	_, err = s.BufferAt(b.Ptr()+250, 32)
	assert.ErrorIs(t, err, ErrOutOfBounds)
	goMem := make([]byte, 8)
	_, err = s.BufferAt(addrOf(goMem), 8)
	assert.ErrorIs(t, err, ErrUnknownPointer)
}

func testPinnedPool(t *testing.T, s *System) {
	p, err := s.NewPinnedPool(PoolConfig{MinSize: 1000, MaxSize: 8192, MaxBytes: 16384, MaxIdlePerClass: 1})
	require.NoError(t, err)
	defer p.Close()
	cfg := p.Config()
	assert.Equal(t, 1024, cfg.MinSize)

	b1, err := p.Get(5000) // class 8192
	require.NoError(t, err)
	assert.Equal(t, 5000, b1.Len())
	assert.Equal(t, KindPinned, b1.Kind())
	bs, err := b1.Bytes()
	require.NoError(t, err)
	bs[4999] = 1
	b2, err := p.Get(8192)
	require.NoError(t, err)
	_, err = p.Get(1)
	assert.ErrorIs(t, err, ErrPoolExhausted)
	_, err = p.Get(8193)
	assert.ErrorIs(t, err, ErrOutOfBounds)
	assert.ErrorIs(t, Free(b1), ErrNotAllocation, "pool buffers go back with Put")

	// GetWait blocks until a Put.
	got := make(chan Buffer, 1)
	go func() {
		b, err := p.GetWait(context.Background(), 100)
		assert.NoError(t, err)
		got <- b
	}()
	select {
	case <-got:
		t.Fatal("GetWait did not wait")
	case <-time.After(10 * time.Millisecond):
	}
	require.NoError(t, p.Put(b2))
	b3 := <-got
	assert.Equal(t, 100, b3.Len())
	assert.ErrorIs(t, p.Put(b2), ErrNotAllocation, "double Put")

	require.NoError(t, p.Put(b1))
	b4, err := p.Get(6000) // reuses b1's allocation
	require.NoError(t, err)
	assert.Equal(t, b1.Ptr(), b4.Ptr())
	held, inUse, _ := p.Stats()
	assert.LessOrEqual(t, held, 16384)
	assert.Equal(t, 2, inUse)
	require.NoError(t, p.Put(b3))
	require.NoError(t, p.Put(b4))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = p.GetWait(ctx, 8192)
	require.NoError(t, err) // room again: no wait needed

	_, err = s.NewPinnedPool(PoolConfig{MinSize: 4096, MaxSize: 1 << 20, MaxBytes: 1 << 16})
	assert.Error(t, err)

	// Buffers let go beyond MaxIdlePerClass are freed by the pool's releaser,
	// and all of them by the time Close returns.
	p2, err := s.NewPinnedPool(PoolConfig{MinSize: 4096, MaxSize: 4096, MaxBytes: 4 * 4096, MaxIdlePerClass: 1})
	require.NoError(t, err)
	var bufs []Buffer
	for range 4 {
		b, err := p2.Get(4096)
		require.NoError(t, err)
		bufs = append(bufs, b)
	}
	for _, b := range bufs {
		require.NoError(t, p2.Put(b))
	}
	held, inUse, idle := p2.Stats()
	assert.Equal(t, []int{4096, 0, 1}, []int{held, inUse, idle}, "three let go, one kept idle")
	require.NoError(t, p2.Close())
	for i, b := range bufs {
		assert.True(t, b.a.freed.Load(), "buffer %d freed by Close", i)
	}
}

func testIPC(t *testing.T, s *System) {
	b := allocKind(t, s, KindDevice, 4096)
	sl, _ := b.Slice(1024, 512)
	h, err := s.IPCGetHandle(sl)
	if s.Backend() == BackendHost {
		assert.ErrorIs(t, err, ErrNotSupported)
		return
	}
	if errors.Is(err, ErrNotSupported) {
		t.Skipf("CUDA IPC handles are not supported by this device or driver: %v", err)
	}
	require.NoError(t, err)
	assert.Equal(t, uint64(1024), h.Offset)
	assert.Equal(t, uint64(512), h.Length)
	// Another slice of the allocation: the same (cached) handle, its own
	// offset and length.
	sl2, _ := b.Slice(0, 100)
	h2, err := s.IPCGetHandle(sl2)
	require.NoError(t, err)
	assert.Equal(t, h.Handle, h2.Handle)
	assert.Equal(t, uint64(0), h2.Offset)
	assert.Equal(t, uint64(100), h2.Length)
	assert.Equal(t, uint64(4096), h2.Size)
	// The real driver refuses to open a handle in the process that exported
	// it (cross-process use is tested with the transport); the error names
	// the call. The fake driver can be told to allow it, to test the cache.
	d := dev0(t, s)
	x, err := d.IPCOpen(h)
	if err != nil {
		assert.Contains(t, err.Error(), "cuIpcOpenMemHandle")
		return
	}
	require.NoError(t, CopyFromHost(sl, pattern(512, 9)))
	y, err := d.IPCOpen(h) // cached: same mapping
	require.NoError(t, err)
	assert.Equal(t, x.Ptr(), y.Ptr())
	assert.Equal(t, 512, x.Len())
	got := make([]byte, 512)
	require.NoError(t, CopyToHost(got, x))
	assert.Equal(t, pattern(512, 9), got)
	k, kd := s.KindOf(x.Ptr())
	assert.Equal(t, KindDevice, k)
	assert.Same(t, d, kd)
	assert.ErrorIs(t, Free(x), ErrNotAllocation, "IPC mappings are closed, not freed")
	require.NoError(t, IPCClose(x))
	require.NoError(t, CopyToHost(got, y), "mapping still referenced")
	require.NoError(t, IPCClose(y))
	assert.ErrorIs(t, CopyToHost(got, y), ErrFreed)
	assert.ErrorIs(t, IPCClose(y), ErrFreed)
	bad := h
	bad.Offset = 1 << 40
	_, err = d.IPCOpen(bad)
	assert.ErrorIs(t, err, ErrOutOfBounds)
}
