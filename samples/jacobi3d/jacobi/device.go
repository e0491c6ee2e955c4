package jacobi

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/actor"
	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
)

// This file is the -gpu mode: every block's field lives in device memory,
// the stencil, the face packing and the ghost unpacking run as kernels on
// the block's stream (devkernels.go: Go kernels on the host backend, the
// device code of kernels.cu on cuda), and halo faces travel as device
// buffers, either as a gpu.Buffer field of an actor message (the GPU
// Messaging API) or through transport channels (the Channel API).

// GPU halo APIs (Config.GPUAPI).
const (
	// APIMessaging sends each face as the gpu.Buffer field of a DeviceHalo
	// actor message; on the receiving rank it lands in the buffer the
	// block's PostReceiveDevice hook names.
	APIMessaging = "messaging"
	// APIChannel sends each face through a transport Channel between the
	// two blocks' ranks, one channel per (block, face).
	APIChannel = "channel"
)

// DeviceHalo is Halo in -gpu mode with the Messaging API: Face is the
// sender's device buffer holding the plane (i fastest, then j, then k, as
// float64s). Across ranks its bytes land in the receiver's device memory;
// on the same rank the receiver reads the sender's buffer, which the sender
// does not overwrite before the receiver has used it (see devBlock).
type DeviceHalo struct {
	Iter int
	Dir  int
	Face gpu.Buffer
}

func init() {
	actor.MustRegister[DeviceHalo]()
}

// chanHalo tells a block that a channel receive of its face Dir for
// iteration Iter has completed (a local message, never encoded).
type chanHalo struct {
	Iter, Dir int
	Err       error
}

// devBlock is a block's device state. Faces use two buffers per side, by
// iteration parity: the face of iteration s+2 is written only after the
// neighbour has used that of iteration s, since the neighbour's face of
// s+1, needed for our sweep s+2, is sent after its sweep s+1, which
// unpacked our face of s. So one spare buffer per side is enough: the
// buffers are reused without further synchronization (with channels, beyond
// waiting for the send request that last used a send buffer).
type devBlock struct {
	st   *gpu.Stream
	u, v gpu.Buffer // padded fields (Block.Len() float64s)
	res  gpu.Buffer // the last sweep's residual (8 bytes, device)
	resH gpu.Buffer // its copy on the host (pinned)
	send [NumDirs][2]gpu.Buffer
	recv [NumDirs][2]gpu.Buffer
	// land is the Messaging API hook's next landing parity per side; the
	// hook runs on the runtime's progress goroutine.
	land [NumDirs]atomic.Uint32
	// nbrDir maps a neighbour element's actor id to our side facing it.
	nbrDir map[string]int
	remote [NumDirs]bool // the neighbour lives on another rank

	sendCh, recvCh [NumDirs]*transport.Channel
	sendReq        [NumDirs][2]*transport.ChannelRequest
	// sendDone: Messaging API sends whose buffer is still being read (CUDA
	// IPC between processes; otherwise done when sent).
	sendDone [NumDirs][2]*actor.Completion
	// pending is the iteration whose packed faces wait to be sent (-1:
	// none). Faces of iteration s go out once sweep s+1 is certain to
	// happen (s < granted), so every face sent is received.
	pending int
}

// gpuDevice returns the device of a -gpu run, cfg.Device, else device 0 of
// gpu.Default(), and the stencil kernels its backend runs.
func gpuDevice(cfg *Config) (*gpu.Device, *stencil, error) {
	dev := cfg.Device
	if dev == nil {
		sys, err := gpu.Default()
		if err != nil {
			return nil, nil, fmt.Errorf("jacobi: -gpu: %w", err)
		}
		if dev, err = sys.Device(0); err != nil {
			return nil, nil, fmt.Errorf("jacobi: -gpu: %w", err)
		}
	}
	sten, err := newStencil(dev)
	if err != nil {
		return nil, nil, fmt.Errorf("jacobi: -gpu: the stencil cannot run on %v: %w", dev, err)
	}
	return dev, sten, nil
}

// deviceRes is what a rank's blocks allocate in -gpu mode, released when Run
// returns.
type deviceRes struct {
	dev  *gpu.Device
	sten *stencil

	mu      sync.Mutex
	bufs    []gpu.Buffer
	streams []*gpu.Stream
	chans   map[uint32]*transport.Channel
}

// alloc allocates n bytes of device memory (pinned host memory with host)
// that release frees.
func (r *deviceRes) alloc(n int, host bool) (gpu.Buffer, error) {
	var b gpu.Buffer
	var err error
	if host {
		b, err = r.dev.System().AllocHost(n)
	} else {
		b, err = r.dev.Alloc(n)
	}
	if err != nil {
		return gpu.Buffer{}, err
	}
	r.mu.Lock()
	r.bufs = append(r.bufs, b)
	r.mu.Unlock()
	return b, nil
}

// stream creates a stream that release destroys.
func (r *deviceRes) stream() (*gpu.Stream, error) {
	st, err := r.dev.NewStream()
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	r.streams = append(r.streams, st)
	r.mu.Unlock()
	return st, nil
}

// channel returns this rank's end of channel id with peer, shared by the
// rank's blocks: when both blocks of a pair live on this rank they use one
// channel object (a channel to the rank itself), whose transfers are
// device-to-device copies.
func (r *deviceRes) channel(t *transport.Transport, id uint32, peer int) (*transport.Channel, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c := r.chans[id]; c != nil {
		return c, nil
	}
	c, err := t.Channel(id, peer)
	if err != nil {
		return nil, err
	}
	if r.chans == nil {
		r.chans = map[uint32]*transport.Channel{}
	}
	r.chans[id] = c
	return c, nil
}

// release closes the channels, destroys the streams and frees the device
// memory (work still queued keeps its memory until it has run).
func (r *deviceRes) release() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	var errs []error
	for _, c := range r.chans {
		errs = append(errs, c.Close())
	}
	r.chans = nil
	for _, st := range r.streams {
		errs = append(errs, st.Destroy())
	}
	r.streams = nil
	for _, b := range r.bufs {
		errs = append(errs, gpu.Free(b))
	}
	r.bufs = nil
	errs = append(errs, r.sten.release())
	r.sten = nil
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("jacobi: releasing device memory: %w", err)
	}
	return nil
}

// channelID is the job-unique id of the channel carrying the face that
// block linear sends from its side d.
func channelID(linear, d int) uint32 { return uint32(linear*NumDirs + d) }

// initDevice allocates the block's device state: both fields, initialized
// with the fixed boundary values, the residual word, the face buffers and,
// with the Channel API, the channels.
func (b *block) initDevice() error {
	res := b.rs.dev
	db := &devBlock{pending: -1, nbrDir: map[string]int{}}
	b.dv = db
	// Run releases all of it, also when a step below fails.
	var err error
	if db.st, err = res.stream(); err != nil {
		return err
	}
	n := b.geo.Len() * 8
	if db.u, err = res.alloc(n, false); err != nil {
		return err
	}
	if db.v, err = res.alloc(n, false); err != nil {
		return err
	}
	if db.res, err = res.alloc(8, false); err != nil {
		return err
	}
	if db.resH, err = res.alloc(8, true); err != nil {
		return err
	}
	init := make([]float64, b.geo.Len())
	for d, p := range b.nbr {
		if p == nil {
			b.geo.FillGhost(init, d, BoundaryValue(d))
		}
	}
	host := float64Bytes(init)
	if err := gpu.CopyFromHost(db.u, host); err != nil {
		return err
	}
	if err := gpu.CopyFromHost(db.v, host); err != nil {
		return err
	}
	t := b.rt.Transport()
	for d, p := range b.nbr {
		if p == nil {
			continue
		}
		db.nbrDir[p.Id] = d
		db.remote[d] = actor.RankOf(p) != b.rt.Rank()
		for par := range 2 {
			if db.send[d][par], err = res.alloc(b.geo.FaceLen(d)*8, false); err != nil {
				return err
			}
			if db.recv[d][par], err = res.alloc(b.geo.FaceLen(d)*8, false); err != nil {
				return err
			}
		}
		if b.cfg.GPUAPI != APIChannel {
			continue
		}
		peer := actor.RankOf(p)
		if db.sendCh[d], err = res.channel(t, channelID(b.el.Linear, d), peer); err != nil {
			return fmt.Errorf("channel for face %d: %w", d, err)
		}
		nl := b.el.Array.Linear(neighbourIndex(b.el.Index, d)...)
		if db.recvCh[d], err = res.channel(t, channelID(nl, d^1), peer); err != nil {
			return fmt.Errorf("channel for face %d: %w", d, err)
		}
	}
	return nil
}

// neighbourIndex is the index of the element on side d of idx.
func neighbourIndex(idx actor.Index, d int) []int {
	out := []int{idx[0], idx[1], idx[2]}
	if d%2 == 0 {
		out[d/2]--
	} else {
		out[d/2]++
	}
	return out
}

// PostReceiveDevice implements actor.DevicePostReceiver: a DeviceHalo from
// another rank lands in the next face buffer of the side its sender faces,
// alternating between the two. It runs on the runtime's progress goroutine
// and touches only immutable state and the atomic land counters.
func (b *block) PostReceiveDevice(in *actor.Incoming) gpu.Buffer {
	db := b.dv
	if db == nil || in.Sender == nil {
		return gpu.Buffer{}
	}
	d, ok := db.nbrDir[in.Sender.Id]
	if !ok {
		return gpu.Buffer{} // not a neighbour: the runtime allocates, addHalo refuses it
	}
	buf := db.recv[d][(db.land[d].Add(1)-1)%2]
	if buf.Len() != in.Size {
		return gpu.Buffer{}
	}
	return buf
}

// addDeviceHalo buffers a device face by iteration (addHalo's checks).
func (b *block) addDeviceHalo(iter, dir int, face gpu.Buffer) error {
	db := b.dv
	if db == nil {
		return fmt.Errorf("device halo for face %d, but this run keeps its fields on the host", dir)
	}
	if dir < 0 || dir >= NumDirs || b.nbr[dir] == nil {
		return fmt.Errorf("halo for face %d, which has no neighbour", dir)
	}
	if want := b.geo.FaceLen(dir) * 8; face.Len() != want {
		return fmt.Errorf("halo for face %d has %d bytes, want %d", dir, face.Len(), want)
	}
	hs, err := b.halos.add(iter, b.sweep)
	if err != nil {
		return fmt.Errorf("face %d: %w", dir, err)
	}
	if !hs.dev[dir].IsZero() {
		return fmt.Errorf("two halos of iteration %d for face %d", iter, dir)
	}
	hs.dev[dir] = face
	// A remote face outside our landing buffers was allocated by the
	// runtime (the hook was not found): free it after use.
	hs.owned[dir] = db.remote[dir] && face.Ptr() != db.recv[dir][0].Ptr() && face.Ptr() != db.recv[dir][1].Ptr()
	hs.n++
	return nil
}

// deviceStep does sweep b.sweep+1 on the device: unpack the faces of hs into
// the ghost planes, sweep u into v, pack the new field's faces for the
// neighbours into the send buffers of the next iteration's parity (unless
// last; the caller has waited for their previous sends), copy the residual
// to the host, and wait for the stream. It returns the residual.
func (b *block) deviceStep(hs *haloSet, last bool) (float64, error) {
	db := b.dv
	geo := b.geo
	if hs != nil {
		var dirs []int
		var bufs []gpu.Buffer
		for d, f := range hs.dev {
			if !f.IsZero() {
				dirs = append(dirs, d)
				bufs = append(bufs, f)
			}
		}
		if err := b.rs.dev.sten.faces(db.st, geo, false, db.u, dirs, bufs); err != nil {
			return 0, fmt.Errorf("unpacking faces: %w", err)
		}
	}
	if err := b.rs.dev.sten.sweep(db.st, geo, db.u, db.v, db.res); err != nil {
		return 0, fmt.Errorf("sweep: %w", err)
	}
	db.u, db.v = db.v, db.u
	if !last {
		if err := b.packFacesDevice((b.sweep + 1) % 2); err != nil {
			return 0, err
		}
	}
	if err := gpu.CopyAsync(db.st, db.resH, db.res); err != nil {
		return 0, fmt.Errorf("copying the residual: %w", err)
	}
	if err := db.st.Synchronize(); err != nil {
		return 0, fmt.Errorf("sweep %d on %v: %w", b.sweep+1, db.st.Device(), err)
	}
	if hs != nil {
		for d, f := range hs.dev {
			if hs.owned[d] {
				if err := gpu.Free(f); err != nil {
					return 0, fmt.Errorf("freeing a landed face: %w", err)
				}
			}
		}
	}
	rb, err := db.resH.Bytes()
	if err != nil {
		return 0, err
	}
	return math.Float64frombits(binary.LittleEndian.Uint64(rb)), nil
}

// packFacesDevice enqueues a kernel packing the field's faces into the send
// buffers of parity par.
func (b *block) packFacesDevice(par int) error {
	db := b.dv
	var dirs []int
	var bufs []gpu.Buffer
	for d, p := range b.nbr {
		if p != nil {
			dirs = append(dirs, d)
			bufs = append(bufs, db.send[d][par])
		}
	}
	if err := b.rs.dev.sten.faces(db.st, b.geo, true, db.u, dirs, bufs); err != nil {
		return fmt.Errorf("packing faces: %w", err)
	}
	return nil
}

// sendInitialFaces packs the initial field's faces (iteration 0) and sends
// them once allowed.
func (b *block) sendInitialFaces() error {
	b.rs.begin(time.Now())
	err := b.packFacesDevice(0)
	if err == nil {
		err = b.dv.st.Synchronize()
	}
	b.rs.end(time.Now())
	if err != nil {
		return fmt.Errorf("packing the initial faces: %w", err)
	}
	b.dv.pending = 0
	return b.flushDevice()
}

// flushDevice sends the pending faces once their iteration is below the
// granted sweep (so the neighbours will do the sweep that needs them), and
// with the Channel API posts the receives of the neighbours' faces of the
// same iteration.
func (b *block) flushDevice() error {
	db := b.dv
	s := db.pending
	if s < 0 || s >= b.granted {
		return nil
	}
	db.pending = -1
	par := s % 2
	for d, p := range b.nbr {
		if p == nil {
			continue
		}
		if b.cfg.GPUAPI != APIChannel {
			c, err := b.rt.SendDevice(b.self, p, &DeviceHalo{Iter: s, Dir: d ^ 1, Face: db.send[d][par]})
			if err != nil {
				return fmt.Errorf("sending halo %d of iteration %d: %w", d, s, err)
			}
			db.sendDone[d][par] = c
			continue
		}
		sr, err := db.sendCh[d].Send(db.send[d][par])
		if err != nil {
			return fmt.Errorf("sending halo %d of iteration %d on channel %d: %w", d, s, db.sendCh[d].ID(), err)
		}
		db.sendReq[d][par] = sr
		rr, err := db.recvCh[d].Recv(db.recv[d][par])
		if err != nil {
			return fmt.Errorf("receiving halo %d of iteration %d on channel %d: %w", d, s, db.recvCh[d].ID(), err)
		}
		go b.notifyRecv(rr, s, d)
	}
	return nil
}

// notifyRecv waits for a channel receive and tells the block.
func (b *block) notifyRecv(r *transport.ChannelRequest, iter, dir int) {
	err := r.Wait(b.rs.ctx)
	if err := b.rt.Send(b.self, &chanHalo{Iter: iter, Dir: dir, Err: err}); err != nil {
		b.rs.fail(fmt.Errorf("jacobi: block %v: halo %d of iteration %d: %w", b.el.Index, dir, iter, err))
	}
}

// waitSends waits for the sends of parity par (-1: all) to finish: their
// buffers may then be packed again or freed.
func (b *block) waitSends(par int) error {
	db := b.dv
	for d := range NumDirs {
		for p := range 2 {
			if par >= 0 && p != par {
				continue
			}
			if c := db.sendDone[d][p]; c != nil {
				db.sendDone[d][p] = nil
				if err := c.Wait(b.rs.ctx); err != nil {
					return fmt.Errorf("halo %d send: %w", d, err)
				}
			}
			r := db.sendReq[d][p]
			if r == nil {
				continue
			}
			db.sendReq[d][p] = nil
			if err := r.Wait(b.rs.ctx); err != nil {
				return fmt.Errorf("halo %d send on channel %d: %w", d, db.sendCh[d].ID(), err)
			}
		}
	}
	return nil
}

// deviceField copies the block's padded field to the host.
func (b *block) deviceField() ([]float64, error) {
	host := make([]byte, b.dv.u.Len())
	if err := gpu.CopyToHost(host, b.dv.u); err != nil {
		return nil, fmt.Errorf("copying the field to the host: %w", err)
	}
	out := make([]float64, len(host)/8)
	for i := range out {
		out[i] = math.Float64frombits(binary.LittleEndian.Uint64(host[8*i:]))
	}
	return out, nil
}

// float64Bytes encodes f as little-endian bytes.
func float64Bytes(f []float64) []byte {
	out := make([]byte, 8*len(f))
	for i, x := range f {
		binary.LittleEndian.PutUint64(out[8*i:], math.Float64bits(x))
	}
	return out
}

// float64View views device memory handed to a kernel as float64s. The
// memory is the backend's (8-byte aligned allocations, sliced at multiples
// of 8 here), valid while the kernel runs.
func float64View(b []byte) ([]float64, error) {
	if len(b) == 0 {
		return nil, nil
	}
	p := unsafe.Pointer(unsafe.SliceData(b))
	if len(b)%8 != 0 || uintptr(p)%8 != 0 {
		return nil, fmt.Errorf("jacobi: %d bytes at %p are not whole aligned float64s", len(b), p)
	}
	return unsafe.Slice((*float64)(p), len(b)/8), nil
}

// The block answers the Messaging API's landing question.
var _ actor.DevicePostReceiver = (*block)(nil)

// selfPID is the block's own PID (halos carry it as their sender).
func selfPID(el *actor.Element) *pa.PID { return el.Array.ElementAt(el.Linear) }
