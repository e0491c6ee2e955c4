package gpu

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"pgregory.net/rapid"
)

func openHost(t *testing.T) *System {
	t.Helper()
	s, err := OpenBackend(BackendHost)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func TestSelectionByEnv(t *testing.T) {
	t.Setenv(EnvBackend, "host")
	s, err := Open()
	require.NoError(t, err)
	assert.Equal(t, BackendHost, s.Backend())
	require.NoError(t, s.Close())

	t.Setenv(EnvBackend, "bogus")
	_, err = Open()
	assert.ErrorContains(t, err, "want auto, host or cuda")

	t.Setenv(EnvBackend, "auto")
	s, err = Open()
	require.NoError(t, err)
	if CUDAAvailable() != nil {
		assert.Equal(t, BackendHost, s.Backend(), "auto falls back to host without a GPU")
	} else {
		assert.Equal(t, BackendCUDA, s.Backend())
	}
	require.NoError(t, s.Close())

	t.Setenv(EnvBackend, "cuda")
	s, err = Open()
	if cerr := CUDAAvailable(); cerr != nil {
		require.Error(t, err)
		assert.ErrorIs(t, err, ErrUnavailable)
		// The error names the failing call or library.
		msg := err.Error()
		assert.True(t, strings.Contains(msg, "libcuda.so.1") || strings.Contains(msg, "cu"), msg)
		t.Logf("TROUPE_GPU=cuda here: %v", err)
	} else {
		require.NoError(t, err)
		require.NoError(t, s.Close())
	}
}

func TestHostMultipleDevices(t *testing.T) {
	t.Setenv(EnvHostDevices, "3")
	s := openHost(t)
	require.Len(t, s.Devices(), 3)
	d2, err := s.Device(2)
	require.NoError(t, err)
	b, err := d2.Alloc(64)
	require.NoError(t, err)
	k, d := s.KindOf(b.Ptr())
	assert.Equal(t, KindDevice, k)
	assert.Same(t, d2, d)
	d0, _ := s.Device(0)
	c, err := d0.Alloc(64)
	require.NoError(t, err)
	require.NoError(t, Memset(b, 9))
	require.NoError(t, Copy(c, b)) // peer copy
	got := make([]byte, 64)
	require.NoError(t, CopyToHost(got, c))
	assert.Equal(t, byte(9), got[63])
}

// Freeing a buffer that enqueued work still uses is safe: the work runs on
// valid memory and the release happens after it.
func TestHostFreeWithPendingWork(t *testing.T) {
	s := openHost(t)
	d := dev0(t, s)
	st, err := d.NewStream()
	require.NoError(t, err)
	gate, err := s.AllocHost(8)
	require.NoError(t, err)
	src, err := d.Alloc(1 << 20)
	require.NoError(t, err)
	dst, err := s.AllocHost(1 << 20)
	require.NoError(t, err)
	require.NoError(t, Memset(src, 0x77))

	require.NoError(t, WaitValue64(st, gate, 1, GEQ))
	require.NoError(t, CopyAsync(st, dst, src))
	require.NoError(t, Free(src)) // returns at once
	assert.ErrorIs(t, MemsetAsync(st, src, 0), ErrFreed)
	k, _ := s.KindOf(src.Ptr())
	assert.Equal(t, KindHost, k)
	src.a.mu.Lock()
	released := src.a.released
	src.a.mu.Unlock()
	assert.False(t, released, "memory released while a copy from it is pending")

	require.NoError(t, WriteValue64Host(gate, 1))
	require.NoError(t, st.Synchronize())
	p, _ := dst.Bytes()
	assert.Equal(t, byte(0x77), p[0])
	assert.Equal(t, byte(0x77), p[len(p)-1])
	src.a.mu.Lock()
	released = src.a.released
	src.a.mu.Unlock()
	assert.True(t, released)
}

// Close releases blocked stream waits and joins every stream goroutine.
func TestHostCloseNoLeaks(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	s, err := OpenBackend(BackendHost)
	require.NoError(t, err)
	d := dev0(t, s)
	gate, err := s.AllocHost(8)
	require.NoError(t, err)
	var streams []*Stream
	for range 8 {
		st, err := d.NewStream()
		require.NoError(t, err)
		require.NoError(t, WaitValue64(st, gate, 1, EQ)) // never satisfied
		streams = append(streams, st)
	}
	ev, err := d.NewEvent()
	require.NoError(t, err)
	require.NoError(t, ev.Record(streams[0]))
	require.NoError(t, streams[1].WaitEvent(ev))
	require.NoError(t, streams[2].Destroy()) // destroyed while blocked

	hostWait := make(chan error, 1)
	go func() { hostWait <- WaitValue64Host(context.Background(), gate, 1, EQ) }()
	evWait := make(chan error, 1)
	go func() { evWait <- ev.Synchronize() }()
	time.Sleep(10 * time.Millisecond)

	require.NoError(t, s.Close())
	assert.ErrorIs(t, <-hostWait, ErrClosed)
	assert.ErrorIs(t, <-evWait, ErrClosed)
	assert.ErrorIs(t, streams[0].Synchronize(), ErrClosed)
	assert.ErrorIs(t, Memset(gate, 0), ErrClosed)
	_, err = d.NewStream()
	assert.ErrorIs(t, err, ErrClosed)
	require.NoError(t, s.Close()) // idempotent
}

func TestHostStreamDestroyDrains(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	s, err := OpenBackend(BackendHost)
	require.NoError(t, err)
	defer s.Close()
	d := dev0(t, s)
	st, err := d.NewStream()
	require.NoError(t, err)
	w, err := s.AllocHost(8)
	require.NoError(t, err)
	for i := range 100 {
		require.NoError(t, WriteValue64(st, w, uint64(i+1)))
	}
	require.NoError(t, st.Destroy()) // like cuStreamDestroy: work still runs
	require.NoError(t, WaitValue64Host(context.Background(), w, 100, EQ))
	require.NoError(t, s.Close())
}

// Property: a random program of async operations on two streams, ordered by
// events, gives the result of running it sequentially.
func TestHostStreamsMatchSequentialModel(t *testing.T) {
	s := openHost(t)
	d := dev0(t, s)
	const n = 64
	bufs := make([]Buffer, 3)
	for i := range bufs {
		b, err := d.Alloc(n)
		require.NoError(t, err)
		bufs[i] = b
	}
	streams := make([]*Stream, 2)
	for i := range streams {
		st, err := d.NewStream()
		require.NoError(t, err)
		streams[i] = st
	}
	ev, err := d.NewEvent()
	require.NoError(t, err)

	rapid.Check(t, func(rt *rapid.T) {
		model := make([][]byte, len(bufs))
		for i := range model {
			model[i] = make([]byte, n)
			require.NoError(rt, Memset(bufs[i], 0))
		}
		cur := 0 // operations go to one stream; switching hands over with an event
		steps := rapid.IntRange(1, 40).Draw(rt, "steps")
		for range steps {
			st := streams[cur]
			switch rapid.IntRange(0, 2).Draw(rt, "op") {
			case 0:
				i := rapid.IntRange(0, len(bufs)-1).Draw(rt, "buf")
				off := rapid.IntRange(0, n-1).Draw(rt, "off")
				ln := rapid.IntRange(0, n-off).Draw(rt, "len")
				v := rapid.Byte().Draw(rt, "v")
				sl, err := bufs[i].Slice(off, ln)
				require.NoError(rt, err)
				require.NoError(rt, MemsetAsync(st, sl, v))
				fill(model[i][off:off+ln], v)
			case 1:
				i := rapid.IntRange(0, len(bufs)-1).Draw(rt, "dst")
				j := rapid.IntRange(0, len(bufs)-1).Draw(rt, "src")
				if i == j {
					continue
				}
				require.NoError(rt, CopyAsync(st, bufs[i], bufs[j]))
				copy(model[i], model[j])
			case 2:
				next := 1 - cur
				require.NoError(rt, ev.Record(st))
				require.NoError(rt, streams[next].WaitEvent(ev))
				cur = next
			}
		}
		require.NoError(rt, streams[0].Synchronize())
		require.NoError(rt, streams[1].Synchronize())
		for i := range bufs {
			got := make([]byte, n)
			require.NoError(rt, CopyToHost(got, bufs[i]))
			require.Equal(rt, model[i], got, "buffer %d", i)
		}
	})
}

func TestHostSystemsAreSeparate(t *testing.T) {
	a := openHost(t)
	b := openHost(t)
	x, err := dev0(t, a).Alloc(8)
	require.NoError(t, err)
	y, err := dev0(t, b).Alloc(8)
	require.NoError(t, err)
	assert.ErrorIs(t, Copy(x, y), ErrForeign)
	st, err := dev0(t, b).NewStream()
	require.NoError(t, err)
	assert.ErrorIs(t, WriteValue64(st, x, 1), ErrForeign)
	ev, err := dev0(t, a).NewEvent()
	require.NoError(t, err)
	assert.ErrorIs(t, st.WaitEvent(ev), ErrForeign)
	_, err = b.BufferAt(x.Ptr(), 8)
	assert.True(t, errors.Is(err, ErrUnknownPointer))
}

func TestHostPoolConcurrent(t *testing.T) {
	s := openHost(t)
	p, err := s.NewPinnedPool(PoolConfig{MinSize: 4096, MaxSize: 65536, MaxBytes: 4 * 65536})
	require.NoError(t, err)
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	errc := make(chan error, 8)
	for g := range 8 {
		go func() {
			for i := range 50 {
				b, err := p.GetWait(ctx, 1+(g*977+i*131)%65536)
				if err != nil {
					errc <- err
					return
				}
				held, _, _ := p.Stats()
				if held > 4*65536 {
					errc <- errors.New("pool over its bound")
					return
				}
				if err := p.Put(b); err != nil {
					errc <- err
					return
				}
			}
			errc <- nil
		}()
	}
	for range 8 {
		require.NoError(t, <-errc)
	}
	_, inUse, _ := p.Stats()
	assert.Zero(t, inUse)
}

func TestDefaultAndStrings(t *testing.T) {
	s, err := Default()
	require.NoError(t, err)
	s2, err := Default()
	require.NoError(t, err)
	assert.Same(t, s, s2)
	d := s.Devices()[0]
	assert.Contains(t, d.String(), s.Backend()+":0")
	b, err := d.Alloc(16)
	require.NoError(t, err)
	defer Free(b)
	assert.Same(t, d, b.Device())
	assert.Same(t, s, b.System())
	assert.Contains(t, b.String(), "device dev=0")
	assert.Equal(t, "gpu.Buffer{}", Buffer{}.String())
	p, err := s.AllocHost(8)
	require.NoError(t, err)
	defer Free(p)
	assert.Nil(t, p.Device())
	assert.Equal(t, "GEQ", GEQ.String())
	assert.Equal(t, "managed", KindManaged.String())
	assert.True(t, KindPinned.HostAccessible())
	assert.False(t, KindDevice.HostAccessible())
}

// A KindOf racing a Free must not leave a cached answer for the freed
// range: after Free, no address of it is cached as device memory.
func TestHostKindOfConcurrentFree(t *testing.T) {
	s := openHost(t)
	d := s.Devices()[0]
	const n = 1 << 16 // more addresses than the cache holds: lookups miss
	for iter := range 300 {
		b, err := d.Alloc(n)
		require.NoError(t, err)
		base := b.Ptr()
		var stop atomic.Bool
		looked := make(chan struct{})
		done := make(chan struct{})
		go func() {
			defer close(done)
			for i := 0; !stop.Load(); i++ {
				s.KindOf(base + uintptr(i*7919%n))
				if i == 0 {
					close(looked)
				}
			}
		}()
		<-looked
		for range iter % 8 {
			runtime.Gosched()
		}
		require.NoError(t, Free(b))
		stop.Store(true)
		<-done
		s.mu.Lock()
		for p, e := range s.kcache.m {
			if p-base < n && e.kind != KindHost {
				s.mu.Unlock()
				t.Fatalf("round %d: address %#x of a freed allocation cached as %v", iter, p, e.kind)
			}
		}
		s.mu.Unlock()
	}
}

// Close while another goroutine creates streams and allocates returns,
// releases everything (no mapped bytes left), and the creator then gets
// ErrClosed.
func TestHostCloseRacesCreation(t *testing.T) {
	for iter := range 50 {
		s, err := OpenBackend(BackendHost)
		require.NoError(t, err)
		d := s.Devices()[0]
		created := make(chan struct{})
		result := make(chan error, 1)
		go func() {
			for i := 0; ; i++ {
				var err error
				if i%2 == 0 {
					_, err = d.NewStream()
				} else {
					_, err = d.Alloc(4096)
				}
				if i == 2 {
					close(created)
				}
				if err != nil {
					result <- err
					return
				}
			}
		}()
		<-created
		for range iter % 8 {
			runtime.Gosched()
		}
		closed := make(chan error, 1)
		go func() { closed <- s.Close() }()
		select {
		case err := <-closed:
			require.NoError(t, err)
		case <-time.After(10 * time.Second):
			t.Fatalf("round %d: Close did not return while streams were being created", iter)
		}
		require.ErrorIs(t, <-result, ErrClosed)
		if left := s.be.(*hostBackend).allocated.Load(); left != 0 {
			t.Fatalf("round %d: %d bytes still mapped after Close", iter, left)
		}
	}
}

// Closing a pinned pool wakes a GetWait waiting for a Put.
func TestHostPoolCloseWakesGetWait(t *testing.T) {
	s := openHost(t)
	p, err := s.NewPinnedPool(PoolConfig{MinSize: 4096, MaxSize: 4096, MaxBytes: 4096})
	require.NoError(t, err)
	_, err = p.Get(4096)
	require.NoError(t, err)
	_, err = p.Get(4096)
	require.ErrorIs(t, err, ErrPoolExhausted)
	res := make(chan error, 1)
	go func() {
		_, err := p.GetWait(context.Background(), 4096)
		res <- err
	}()
	runtime.Gosched()
	require.NoError(t, p.Close())
	select {
	case err := <-res:
		require.ErrorIs(t, err, ErrClosed)
	case <-time.After(10 * time.Second):
		t.Fatal("GetWait still waiting after the pool was closed")
	}
}

// After a failed operation a stream runs nothing more (as a GPU after a
// faulting kernel): a value written after it stays unwritten, and an event
// recorded after it completes and reports the error; one recorded before
// reports none.
func TestHostStickyErrorSkipsLaterWork(t *testing.T) {
	s := openHost(t)
	d := s.Devices()[0]
	st, err := d.NewStream()
	require.NoError(t, err)
	before, err := d.NewEvent()
	require.NoError(t, err)
	after, err := d.NewEvent()
	require.NoError(t, err)
	flag, err := s.AllocHost(8)
	require.NoError(t, err)
	boom := errors.New("kernel fault")
	require.NoError(t, before.Record(st))
	require.NoError(t, LaunchHost(st, func([][]byte) error { return boom }))
	require.NoError(t, WriteValue64(st, flag, 1))
	require.NoError(t, after.Record(st))
	require.NoError(t, before.Synchronize())
	require.ErrorIs(t, after.Synchronize(), boom)
	done, err := after.Query()
	require.True(t, done)
	require.ErrorIs(t, err, boom)
	require.ErrorIs(t, st.Synchronize(), boom)
	v, err := ReadValue64(flag)
	require.NoError(t, err)
	require.Zero(t, v, "a value write enqueued after the failed kernel ran")
}

// A zero Stream or Event is refused with ErrDestroyed, not a panic.
func TestHostZeroStreamAndEvent(t *testing.T) {
	openHost(t)
	require.ErrorIs(t, (&Stream{}).Synchronize(), ErrDestroyed)
	require.ErrorIs(t, (&Stream{}).Destroy(), ErrDestroyed)
	_, err := (&Event{}).Query()
	require.ErrorIs(t, err, ErrDestroyed)
	require.ErrorIs(t, (&Event{}).Destroy(), ErrDestroyed)
}

// Several goroutines launch kernels on one stream and synchronize it, or an
// event recorded after their kernel, after some of them: whether the worker
// or a Synchronize runs a kernel, kernels
// run one at a time, in the order they were enqueued, and a synchronize
// returns only after everything its caller enqueued before it has run.
func TestHostSynchronizeRunsWorkInOrder(t *testing.T) {
	s := openHost(t)
	d := dev0(t, s)
	st, err := d.NewStream()
	require.NoError(t, err)
	buf, err := d.Alloc(8)
	require.NoError(t, err)
	var (
		enqMu    sync.Mutex // numbers kernels in enqueue order
		enqueued int64
		ran      atomic.Int64 // kernels run so far
		active   atomic.Int32 // kernels running now
		bad      atomic.Int64 // kernels that ran out of order or beside another
	)
	const goroutines, each = 4, 300
	evs := make([]*Event, goroutines)
	for g := range evs {
		evs[g], err = d.NewEvent()
		require.NoError(t, err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				enqMu.Lock()
				n := enqueued
				enqueued++
				err := LaunchHost(st, func([][]byte) error {
					if active.Add(1) != 1 || ran.Load() != n {
						bad.Add(1)
					}
					ran.Add(1)
					active.Add(-1)
					return nil
				}, buf)
				enqMu.Unlock()
				if err != nil {
					errs <- err
					return
				}
				var wait func() error
				switch (i + g) % 3 {
				case 0:
					wait = st.Synchronize
				case 1:
					if err := evs[g].Record(st); err != nil {
						errs <- err
						return
					}
					wait = evs[g].Synchronize
				}
				if wait != nil {
					if err := wait(); err != nil {
						errs <- err
						return
					}
					if ran.Load() <= n {
						errs <- fmt.Errorf("a synchronize returned before kernel %d ran (%d ran)", n, ran.Load())
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	require.NoError(t, st.Synchronize())
	require.Equal(t, int64(goroutines*each), ran.Load())
	require.Zero(t, bad.Load(), "kernels run out of order or two at once")
}

// A size class above the largest power of two an int holds is refused:
// rounding MinSize 2^62+1 up overflowed to a negative size and
// NewPinnedPool panicked (makeslice: len out of range).
func TestHostPoolHugeClassRefused(t *testing.T) {
	s := openHost(t)
	for _, cfg := range []PoolConfig{
		{MinSize: 1<<62 + 1},
		{MinSize: math.MaxInt, MaxSize: math.MaxInt, MaxBytes: math.MaxInt},
		{MaxSize: 1<<62 + 1, MaxBytes: math.MaxInt},
	} {
		_, err := s.NewPinnedPool(cfg)
		require.ErrorIs(t, err, ErrOutOfBounds, "%+v", cfg)
	}
	p, err := s.NewPinnedPool(PoolConfig{MinSize: 1 << 62, MaxSize: 1 << 62, MaxBytes: math.MaxInt})
	require.NoError(t, err)
	require.NoError(t, p.Close())
}

// A Get whose allocation fails gives its room in the pool back and wakes
// the GetWait calls that found the pool exhausted by its reservation: they
// waited for a Put, which never comes when nothing else is in use.
func TestHostPoolFailedAllocWakesGetWait(t *testing.T) {
	s := openHost(t)
	p, err := s.NewPinnedPool(PoolConfig{MinSize: 4096, MaxSize: 4096, MaxBytes: 4096})
	require.NoError(t, err)
	// Allocations wait (System.enter) while the test holds s.life.
	s.life.Lock()
	got := make(chan error, 1)
	go func() {
		_, err := p.Get(4096)
		got <- err
	}()
	for held, _, _ := p.Stats(); held != 4096; held, _, _ = p.Stats() {
		runtime.Gosched() // until the Get has reserved the pool's only room
	}
	// What a GetWait finds now: the pool exhausted, and the channel it
	// waits on.
	_, changed, err := p.tryGet(4096)
	require.ErrorIs(t, err, ErrPoolExhausted)
	// The system closes under the reserving Get: its allocation fails.
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	for !s.closed.Load() {
		runtime.Gosched()
	}
	s.life.Unlock()
	require.ErrorIs(t, <-got, ErrClosed)
	held, _, _ := p.Stats()
	require.Zero(t, held, "the failed Get kept its reservation")
	select {
	case <-changed:
	default:
		t.Fatal("the failed Get gave its room back without waking GetWait")
	}
	require.NoError(t, <-closed)
}

// TestLiveAllocs: Device.LiveAllocs counts the device's Alloc and
// AllocManaged allocations until they are freed, not pinned host memory.
func TestLiveAllocs(t *testing.T) {
	s := openHost(t)
	d, err := s.Device(0)
	require.NoError(t, err)
	assert.Equal(t, 0, d.LiveAllocs())
	a, err := d.Alloc(64)
	require.NoError(t, err)
	m, err := d.AllocManaged(64)
	require.NoError(t, err)
	h, err := s.AllocHost(64)
	require.NoError(t, err)
	assert.Equal(t, 2, d.LiveAllocs())
	require.NoError(t, Free(a))
	require.NoError(t, Free(m))
	require.NoError(t, Free(h))
	assert.Equal(t, 0, d.LiveAllocs())
}
