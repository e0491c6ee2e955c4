package transport

// Same-host zero copy for large tagged messages (CMA).
//
// UCX 1.13 does not use its CMA transport on endpoints with peer error
// handling, which troupe needs to notice dead ranks, so between processes
// on one host a large message would travel through the shared-memory FIFO
// and be copied twice (about 3 to 10 GB/s for 1 MiB). Instead, a tagged
// send of at least Options.CMAThreshold bytes to a rank on the same host
// sends a 32-byte descriptor (address, length, validity word) under the
// message's own tag with the top kind bit set; the receiver's tagged
// receives ignore that bit, so the descriptor matches exactly like the
// message would, in order. The receiver then copies the bytes straight from
// the sender's memory with one process_vm_readv (Linux cross-memory attach)
// into the receive buffer, and acknowledges with a small active message,
// which completes the send.
//
// The validity word is an 8-byte word of the sender's memory that holds
// cmaValid while the send waits for its acknowledgement (cmaword.go). A
// sender that fails the send otherwise (Close, the receiver lost) clears it
// before the send completes, since the buffer then goes back to its
// application, which may write it while the descriptor still waits at the
// receiver. The receiver reads the word after the data, in the same call: a
// cleared word fails the receive with ErrWithdrawn instead of delivering
// whatever the buffer holds now.
//
// Each rank publishes at start-up whether it takes part (Linux, the
// syscall works, UCX_TLS allows shared memory, TROUPE_CMA is not "off"), its
// node id (boot id and host name), pid and the address of a probe word. A
// sender uses the path to a peer only if both take part, share the node id,
// and it can read the peer's probe word (same user, ptrace rules allow it):
// the check stands for the peer reading back. The same exchange tells every
// rank which peers share its host (Transport.SameHost) and which take part
// in CUDA IPC for channels (channel_ipc.go).

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"unsafe"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/troupe-hpc/troupe/transport/ucx"
)

const (
	// cmaBit marks a USER tag whose message is a CMA descriptor.
	cmaBit = uint64(1) << 63
	// userRecvMask matches USER tags with or without cmaBit (kind 13, the
	// kind with that bit, is otherwise unused).
	userRecvMask = FullMask &^ cmaBit

	cmaDescSize = 32
	cmaAckSize  = 24
	cmaMagic    = uint64(0x74726f7570652d63) // "troupe-c"

	// amCMAAck is the active-message id of acknowledgements.
	amCMAAck uint16 = 0x30
	// amCMAData carries an active message whose data stays in the
	// sender's memory: the user's header, and as data a descriptor naming
	// the user's id.
	amCMAData uint16 = 0x31
	cmaAMSize        = cmaDescSize + 16

	// DefaultCMAThreshold is the smallest tagged message sent by CMA.
	DefaultCMAThreshold = 64 << 10
)

// cmaProbeWord is read by peers to check that they may read this process.
var cmaProbeWord uint64

func init() {
	var b [8]byte
	_, _ = rand.Read(b[:])
	cmaProbeWord = binary.LittleEndian.Uint64(b[:]) | 1
}

// CMAStats counts same-host zero-copy transfers.
type CMAStats struct {
	Enabled  bool   // this rank takes part
	Sent     int64  // messages this rank sent by CMA
	Received int64  // messages this rank received by CMA
	Off      string // why this rank does not take part ("" when it does)
}

// cmaPeer is what a peer published, and whether it can be read.
type cmaPeer struct {
	pid   int
	addr  uint64 // address of its probe word
	word  uint64 // the probe word's value
	state atomic.Int32
}

const (
	cmaUnknown int32 = iota
	cmaUsable
	cmaUnusable
)

// cmaState is the transport's CMA state; guarded by the worker lock except
// where noted.
type cmaState struct {
	on     bool                // this rank takes part (read-only after New)
	off    string              // why not (read-only after New)
	thresh int                 // read-only after New
	peers  []*cmaPeer          // by rank; nil entries do not take part (read-only after New)
	sends  map[uint64]*Request // sends waiting for their acknowledgement, by validity word address
	words  []*uint64           // idle validity words (cmaword.go)
	held   map[uint64]cmaDesc  // descriptors taken out of UCX by Iprobe, by wire tag
	// probing: descriptors Iprobe took out of UCX that are still being
	// received, by wire tag, with the receive posted meanwhile (if any).
	probing map[uint64]*Request
	jobs    []cmaJob // reads to run outside the lock
	sent    atomic.Int64
	recvd   atomic.Int64
}

// cmaSend is the sender's state of one CMA message.
type cmaSend struct {
	word   *uint64 // its validity word, until the send completes
	id     uint64  // the word's address: names the send in descriptor and acknowledgement
	desc   [cmaDescSize]byte
	acked  bool
	ackErr error
}

// cmaDesc is a decoded descriptor: the message's address and length in the
// sender's memory, and the address of its validity word there, which also
// names the message in the acknowledgement.
type cmaDesc struct {
	addr, n, word uint64
}

// cmaJob is a read waiting to run outside the worker lock.
type cmaJob struct {
	r *Request
	d cmaDesc
}

// cmaWanted reports whether this process may take part.
func cmaWanted(opts Options) (bool, string) {
	if v, ok := syscallGetenv("TROUPE_CMA"); ok && (v == "off" || v == "0" || v == "n") {
		return false, "TROUPE_CMA=" + v
	}
	if v, ok := syscallGetenv("UCX_TLS"); ok && !tlsAllowsCMA(v) {
		return false, "UCX_TLS=" + v
	}
	var got uint64
	if err := cmaRead(os.Getpid(), uint64(uintptr(unsafe.Pointer(&cmaProbeWord))), [][]byte{unsafe.Slice((*byte)(unsafe.Pointer(&got)), 8)}); err != nil || got != cmaProbeWord {
		return false, fmt.Sprintf("process_vm_readv does not work here (%v)", err)
	}
	return true, ""
}

// tlsAllowsCMA reports whether a UCX_TLS value allows shared-memory
// transports: "all", "sm", "shm", or one of UCX's shared-memory transports
// (posix, sysv, xpmem, cma, knem) listed, or an exclusion list ("^...")
// that names none of them. Before 2026-11-25 "self,posix" and the like
// turned CMA off.
func tlsAllowsCMA(v string) bool {
	v = strings.TrimSpace(v)
	if v == "" {
		return true
	}
	exclude := strings.HasPrefix(v, "^")
	named := false
	for _, f := range strings.Split(strings.TrimPrefix(v, "^"), ",") {
		switch strings.TrimSpace(f) {
		case "all", "sm", "shm", "posix", "sysv", "xpmem", "cma", "knem":
			named = true
		}
	}
	return named != exclude
}

// cmaThreshold reads TROUPE_CMA_THRESHOLD (bytes) over the option.
func cmaThreshold(opts Options) (int, error) {
	if v, ok := syscallGetenv("TROUPE_CMA_THRESHOLD"); ok {
		n, err := strconv.Atoi(v)
		if err != nil || n < cmaDescSize {
			return 0, fmt.Errorf("%w: TROUPE_CMA_THRESHOLD=%q: want a byte count >= %d", ErrInvalid, v, cmaDescSize)
		}
		return n, nil
	}
	if opts.CMAThreshold > 0 {
		return max(opts.CMAThreshold, cmaDescSize), nil
	}
	return DefaultCMAThreshold, nil
}

func bootID() string {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	return string(bytes.TrimSpace(b))
}

// nodeID names this host: the kernel's boot id and the host name (two
// containers on one kernel with different host names count as two hosts).
// Empty when the boot id cannot be read.
func nodeID() string {
	id := bootID()
	if id == "" {
		return ""
	}
	host, _ := os.Hostname()
	return id + "\n" + host
}

// Flags of hostInfo's first byte.
const (
	infoCMA    = 1 << 0 // takes part in CMA
	infoGPUIPC = 1 << 1 // takes part in CUDA IPC for channels (channel_ipc.go)
)

// hostInfo is what a rank publishes at start-up: flags(1) pid(8) addr(8)
// word(8), the processors it may run on (a length (2) and a bitmap,
// sched_getaffinity's, trailing zero bytes dropped), then its node id.
// Ranks with the same node id share a host.
func hostInfo(cma, gpuIPC bool) []byte {
	b := make([]byte, 25, 25+2+16+64)
	if cma {
		b[0] |= infoCMA
	}
	if gpuIPC {
		b[0] |= infoGPUIPC
	}
	binary.LittleEndian.PutUint64(b[1:], uint64(os.Getpid()))
	binary.LittleEndian.PutUint64(b[9:], uint64(uintptr(unsafe.Pointer(&cmaProbeWord))))
	binary.LittleEndian.PutUint64(b[17:], cmaProbeWord)
	mask := affinityMask()
	b = binary.LittleEndian.AppendUint16(b, uint16(len(mask)))
	b = append(b, mask...)
	return append(b, nodeID()...)
}

// affinityMask is the bitmap of the processors this process may run on
// (bit i of byte j: processor 8j+i), or nil if the kernel will not say.
func affinityMask() []byte {
	var set unix.CPUSet
	if unix.SchedGetaffinity(0, &set) != nil {
		return nil
	}
	var mask []byte
	for cpu := 0; cpu < 8*int(unsafe.Sizeof(set)); cpu++ {
		if set.IsSet(cpu) {
			for len(mask) <= cpu/8 {
				mask = append(mask, 0)
			}
			mask[cpu/8] |= 1 << (cpu % 8)
		}
	}
	return mask
}

// peerHost is a rank's hostInfo, read.
type peerHost struct {
	flags           byte
	pid, addr, word uint64
	cpus            []byte // affinity bitmap
	node            string
}

// parseHostInfo reads a hostInfo entry, or reports false for one too
// short for its own lengths or whose process id no process can have (0,
// or above the 2^31-1 a pid_t holds: process_vm_readv would take its low
// 32 bits, another process's id).
func parseHostInfo(b []byte) (peerHost, bool) {
	if len(b) < 27 {
		return peerHost{}, false
	}
	n := int(binary.LittleEndian.Uint16(b[25:]))
	if len(b) < 27+n {
		return peerHost{}, false
	}
	if pid := binary.LittleEndian.Uint64(b[1:]); pid == 0 || pid > math.MaxInt32 {
		return peerHost{}, false
	}
	return peerHost{
		flags: b[0],
		pid:   binary.LittleEndian.Uint64(b[1:]),
		addr:  binary.LittleEndian.Uint64(b[9:]),
		word:  binary.LittleEndian.Uint64(b[17:]),
		cpus:  b[27 : 27+n],
		node:  string(b[27+n:]),
	}, true
}

// unionCPUs counts the processors in the union of the bitmaps.
func unionCPUs(masks [][]byte) int {
	var union []byte
	for _, m := range masks {
		for len(union) < len(m) {
			union = append(union, 0)
		}
		for i, c := range m {
			union[i] |= c
		}
	}
	n := 0
	for _, c := range union {
		n += bits.OnesCount8(c)
	}
	return n
}

// cmaSetup decides whether this rank takes part in CMA and in CUDA IPC for
// channels, and learns which peers share its host and take part. Every rank
// calls it: it is one collective exchange.
func (t *Transport) cmaSetup(exchange func([]byte) ([][]byte, error)) error {
	on, why := cmaWanted(t.opts)
	thresh, err := cmaThreshold(t.opts)
	if err != nil {
		return err
	}
	ipcOn, ipcWhy := gpuIPCWanted(t.opts)
	all, err := exchange(hostInfo(on, ipcOn))
	if err != nil {
		return fmt.Errorf("exchanging CMA information: %w", err)
	}
	if len(all) != t.size {
		return fmt.Errorf("CMA exchange returned %d entries for %d ranks", len(all), t.size)
	}
	self := nodeID()
	pid := uint64(os.Getpid())
	peers := make([]peerHost, t.size)
	t.sameHost = make([]bool, t.size)
	t.sameProcess = make([]bool, t.size)
	var masks [][]byte
	for rank, b := range all {
		// An entry too short to read (another build?) shares nothing, as
		// before entries carried the masks.
		p, ok := parseHostInfo(b)
		peers[rank] = p
		t.sameHost[rank] = rank == t.rank || (ok && self != "" && p.node == self)
		t.sameProcess[rank] = rank == t.rank || (t.sameHost[rank] && p.pid == pid)
		if t.sameHost[rank] {
			masks = append(masks, p.cpus)
		}
	}
	t.hostCPUs = unionCPUs(masks)
	t.gpuIPCSetup(ipcOn, ipcWhy, func(rank int) bool {
		p := peers[rank]
		return rank != t.rank && t.sameHost[rank] && p.flags&infoGPUIPC != 0 && p.pid != pid
	})
	t.cma = cmaState{on: on, off: why, thresh: thresh, sends: map[uint64]*Request{}, held: map[uint64]cmaDesc{}, probing: map[uint64]*Request{}}
	if !on {
		t.log.Debug("same-host zero copy (CMA) off", zap.String("why", why))
		return nil
	}
	t.cma.peers = make([]*cmaPeer, t.size)
	n := 0
	for rank, p := range peers {
		if rank == t.rank || !t.sameHost[rank] || p.flags&infoCMA == 0 {
			continue
		}
		t.cma.peers[rank] = &cmaPeer{pid: int(p.pid), addr: p.addr, word: p.word}
		n++
	}
	t.log.Debug("same-host zero copy (CMA) on", zap.Int("peers", n), zap.Int("threshold", thresh))
	return nil
}

// SameProcess reports whether rank peer runs in this process (the rank
// itself, or the ranks of StartLocal), as the ranks learnt at start-up.
func (t *Transport) SameProcess(peer int) bool {
	return peer >= 0 && peer < len(t.sameProcess) && t.sameProcess[peer]
}

// CMAPeer reports whether large messages to rank peer go by same-host zero
// copy (cross-memory attach): both ranks take part and share this host,
// and reading the peer's memory has not been found to fail.
func (t *Transport) CMAPeer(peer int) bool {
	if !t.cma.on || peer < 0 || peer >= len(t.cma.peers) {
		return false
	}
	p := t.cma.peers[peer]
	return p != nil && p.state.Load() != cmaUnusable
}

// useCMA reports whether a send of n bytes to dst goes by CMA, the
// threshold being Options.CMAThreshold, or with pull (AMPull) the smaller
// of it and PullMin. It may be called without the worker lock.
func (t *Transport) useCMA(dst, n int, pull bool) bool {
	thresh := t.cma.thresh
	if pull {
		thresh = min(thresh, PullMin)
	}
	if !t.cma.on || n < thresh || t.cma.peers == nil {
		return false
	}
	p := t.cma.peers[dst]
	if p == nil {
		return false
	}
	switch p.state.Load() {
	case cmaUsable:
		return true
	case cmaUnusable:
		return false
	}
	var got uint64
	err := cmaRead(p.pid, p.addr, [][]byte{unsafe.Slice((*byte)(unsafe.Pointer(&got)), 8)})
	if err != nil || got != p.word {
		p.state.Store(cmaUnusable)
		t.log.Debug("same-host zero copy (CMA) unusable to peer", zap.Int("peer", dst), zap.Error(err))
		return false
	}
	p.state.Store(cmaUsable)
	return true
}

// cmaRead copies len(sum of dst) bytes from address addr of process pid
// into dst.
func cmaRead(pid int, addr uint64, dst [][]byte) error {
	total := 0
	for _, b := range dst {
		total += len(b)
	}
	return cmaReadv(pid, []unix.RemoteIovec{{Base: uintptr(addr), Len: total}}, dst)
}

// cmaReadv copies the bytes of the ranges remote of process pid, in order,
// into dst, which holds as many bytes as the ranges. The kernel reads the
// ranges of one process_vm_readv in order; a read cut short goes on with a
// new call from where it stopped, so a range is always read after those
// before it.
func cmaReadv(pid int, remote []unix.RemoteIovec, dst [][]byte) error {
	const maxIOV = 1024
	remote = append([]unix.RemoteIovec(nil), remote...) // advanced as it is read
	local := make([]unix.Iovec, 0, min(len(dst), maxIOV))
	var rv []unix.RemoteIovec
	for len(dst) > 0 {
		local = local[:0]
		total := 0
		for len(dst) > 0 && len(local) < maxIOV {
			if b := dst[0]; len(b) > 0 {
				v := unix.Iovec{Base: &b[0]}
				v.SetLen(len(b))
				local = append(local, v)
				total += len(b)
			}
			dst = dst[1:]
		}
		for total > 0 {
			// The next total bytes of remote.
			rv = rv[:0]
			for i, k := 0, total; i < len(remote) && k > 0 && len(rv) < maxIOV; i++ {
				if remote[i].Len == 0 {
					continue
				}
				v := remote[i]
				v.Len = min(v.Len, k)
				rv = append(rv, v)
				k -= v.Len
			}
			n, err := unix.ProcessVMReadv(pid, local, rv, 0)
			if err != nil {
				return err
			}
			if n <= 0 {
				return fmt.Errorf("process_vm_readv read %d of %d bytes", n, total)
			}
			total -= n
			// Drop what was read from both vectors.
			for k := n; k > 0; {
				if remote[0].Len <= k {
					k -= remote[0].Len
					remote = remote[1:]
					continue
				}
				remote[0].Base += uintptr(k)
				remote[0].Len -= k
				k = 0
			}
			for n > 0 {
				l := int(local[0].Len)
				if n >= l {
					n -= l
					local = local[1:]
					continue
				}
				local[0].Base = (*byte)(unsafe.Add(unsafe.Pointer(local[0].Base), n))
				local[0].SetLen(l - n)
				n = 0
			}
		}
	}
	return nil
}

// encodeDesc writes the descriptor of n bytes at addr whose validity word
// is at word into b (cmaDescSize bytes): magic(8) addr(8) n(8) word(8).
func encodeDesc(b []byte, addr, n, word uint64) {
	binary.LittleEndian.PutUint64(b[0:], cmaMagic)
	binary.LittleEndian.PutUint64(b[8:], addr)
	binary.LittleEndian.PutUint64(b[16:], n)
	binary.LittleEndian.PutUint64(b[24:], word)
}

// startCMASend sends r's descriptor; the worker lock is held. r completes
// when the receiver acknowledges.
func startCMASend(t *Transport, r *Request) {
	c, err := t.cmaNewSend()
	if err != nil {
		t.log.Warn("same-host zero copy (CMA) send goes through UCX", zap.Error(err))
		startSend(t, r)
		return
	}
	p, wire, ok := t.sendTo(r)
	if !ok {
		t.cmaWordIdle(c)
		return
	}
	t.bundleFlush(r.peer) // posts before this send leave before it
	encodeDesc(c.desc[:], uint64(uintptr(r.b.Ptr)), uint64(r.b.Len), c.id)
	r.cma = c
	ureq, err := t.postUserSend(p, r, ucx.Buffer{Ptr: unsafe.Pointer(&c.desc[0]), Len: cmaDescSize}, wire|cmaBit)
	if err != nil {
		t.unsend(r, wire)
		t.fail(r, fmt.Errorf("transport: send to rank %d tag %d: %w", r.peer, r.tag, err))
		return
	}
	t.cma.sends[c.id] = r
	t.cma.sent.Add(1)
	p.pending[r] = struct{}{}
	if ureq.Pending() {
		t.track(r, ureq, unsafe.Pointer(&c.desc[0]))
	}
}

// cmaSendFinished handles the completion of a CMA send's descriptor; the
// worker lock is held. It reports whether it took care of r.
func (t *Transport) cmaSendFinished(r *Request, st ucx.Status) bool {
	if st != ucx.StatusOK {
		delete(t.cma.sends, r.cma.id)
		return false // fail as any send
	}
	r.ureq = ucx.Request{}
	if r.cma.acked {
		t.cmaSendDone(r)
	}
	return true
}

func (t *Transport) cmaSendDone(r *Request) {
	if r.cma.ackErr != nil {
		t.fail(r, r.cma.ackErr)
		return
	}
	t.complete(r)
}

// onCMAAck completes the send an acknowledgement names: id(8) code(8)
// receiver rank(8), the id being the address of the send's validity word. code 0: read (or truncated, which only the receiver
// reports); otherwise the receiver could not read the sender's memory.
func (t *Transport) onCMAAck(m *AMMessage) {
	if len(m.Header) != cmaAckSize {
		t.log.Warn("malformed CMA acknowledgement dropped", zap.Int("bytes", len(m.Header)))
		return
	}
	id := binary.LittleEndian.Uint64(m.Header[0:])
	code := binary.LittleEndian.Uint64(m.Header[8:])
	from := int(binary.LittleEndian.Uint64(m.Header[16:]))
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.cma.sends[id]
	if r == nil || r.peer != from {
		t.log.Warn("CMA acknowledgement for no pending send dropped", zap.Uint64("id", id), zap.Int("from", from))
		return
	}
	delete(t.cma.sends, id)
	r.cma.acked = true
	if code != 0 {
		r.cma.ackErr = fmt.Errorf("transport: send to rank %d tag %d: the receiver could not read the message from this process's memory (%w)", r.peer, r.tag, unix.Errno(code))
	}
	if !r.ureq.Pending() {
		t.cmaSendDone(r)
	}
}

// cmaRecvBuffer returns the buffer a USER receive is posted with when CMA
// is on: r's own, or a scratch buffer when r's is too small to hold a
// descriptor. The descriptor itself is read from the completion event (a
// later receive into the same memory may already have overwritten it).
func (t *Transport) cmaRecvBuffer(r *Request) ucx.Buffer {
	r.userRecv = true
	if r.bufLen >= cmaDescSize {
		return r.b
	}
	r.scratch = make([]byte, cmaDescSize)
	return ucx.Buffer{Ptr: unsafe.Pointer(&r.scratch[0]), Len: cmaDescSize}
}

// userMask is the mask USER receives and probes use.
func (t *Transport) userMask() uint64 {
	if t.cma.on {
		return userRecvMask
	}
	return FullMask
}

// cmaRecvFinished handles the completion of a USER receive that may carry a
// descriptor or have landed in scratch; the worker lock is held. It reports
// whether it took care of r.
func (t *Transport) cmaRecvFinished(r *Request, e *ucx.Event) bool {
	st, n := e.Status(), e.Length()
	// The descriptor was copied into e as the receive completed.
	if e.SenderTag()&cmaBit != 0 && st == ucx.StatusOK {
		// The UCX request is gone (freed with its event): nothing is left
		// to cancel, and the read below completes r.
		r.ureq = ucx.Request{}
		d, err := decodeDesc(e.Peek(), r.peer, r.tag)
		if err != nil {
			t.fail(r, err)
			return true
		}
		t.cmaArrived(r, d)
		return true
	}
	if r.scratch == nil || st != ucx.StatusOK {
		return false
	}
	// A small message received into scratch: copy it out.
	if n > r.bufLen {
		r.status = Status{Source: r.peer, Tag: r.tag, Size: n}
		t.fail(r, &TruncatedError{Source: r.peer, Tag: r.tag, Size: n, BufLen: r.bufLen})
		return true
	}
	scatter(r.userBufs(), r.scratch[:n])
	r.status = Status{Source: r.peer, Tag: r.tag, Size: n}
	t.complete(r)
	return true
}

// userBufs returns r's receive memory as slices.
func (r *Request) userBufs() [][]byte {
	if r.bufs != nil {
		return r.bufs
	}
	if r.b.Ptr == nil {
		return nil
	}
	return [][]byte{unsafe.Slice((*byte)(r.b.Ptr), r.b.Len)}
}

func scatter(dst [][]byte, src []byte) {
	for _, b := range dst {
		if len(src) == 0 {
			return
		}
		src = src[copy(b, src):]
	}
}

// decodeDesc reads a descriptor encodeDesc wrote. A size of 2^63 bytes or
// more, or a validity word address that is zero or not 8-byte aligned, is
// a protocol error.
func decodeDesc(b []byte, peer, tag int) (cmaDesc, error) {
	if len(b) != cmaDescSize || binary.LittleEndian.Uint64(b) != cmaMagic {
		return cmaDesc{}, fmt.Errorf("%w: recv from rank %d tag %d: malformed CMA descriptor (%d bytes)", ErrProtocol, peer, tag, len(b))
	}
	d := cmaDesc{
		addr: binary.LittleEndian.Uint64(b[8:]),
		n:    binary.LittleEndian.Uint64(b[16:]),
		word: binary.LittleEndian.Uint64(b[24:]),
	}
	if d.n > math.MaxInt64 {
		return cmaDesc{}, fmt.Errorf("%w: recv from rank %d tag %d: CMA descriptor of %d bytes", ErrProtocol, peer, tag, d.n)
	}
	if d.word == 0 || d.word%8 != 0 {
		return cmaDesc{}, fmt.Errorf("%w: recv from rank %d tag %d: CMA descriptor with validity word at %#x", ErrProtocol, peer, tag, d.word)
	}
	return d, nil
}

// cmaArrived serves receive r from descriptor d; the worker lock is held.
func (t *Transport) cmaArrived(r *Request, d cmaDesc) {
	if d.n > uint64(r.bufLen) {
		t.cmaAck(r.peer, d.word, 0)
		r.status = Status{Source: r.peer, Tag: r.tag, Size: int(d.n)}
		t.fail(r, &TruncatedError{Source: r.peer, Tag: r.tag, Size: int(d.n), BufLen: r.bufLen})
		return
	}
	t.cma.jobs = append(t.cma.jobs, cmaJob{r: r, d: d})
}

// runCMAJobs copies the messages of jobs, then acknowledges and completes
// them. Each message's validity word is read after its bytes, in the same
// call (cmaReadWithWord): a message whose sender withdrew it fails with
// ErrWithdrawn and is not acknowledged. All but the first cmaDescSize bytes of each message are copied
// into place without the worker lock; those first bytes are read into a
// staging array with them and put in place under the lock, because
// a descriptor of a later message may land there: a program that posts
// several receives into one buffer (as bandwidth benchmarks do) must get
// garbage data at worst, never a descriptor overwritten between UCX
// writing it and the receive callback reading it (both under the lock).
func (t *Transport) runCMAJobs(jobs []cmaJob) {
	errs := make([]error, len(jobs))
	heads := make([][cmaDescSize]byte, len(jobs)) // first bytes, staged
	for i, j := range jobs {
		pid := 0
		if t.cma.peers != nil && t.cma.peers[j.r.peer] != nil {
			pid = t.cma.peers[j.r.peer].pid
		}
		if pid == 0 {
			errs[i] = unix.ESRCH
			continue
		}
		n := int(j.d.n)
		_, tail := splitHead(limit(j.r.userBufs(), n), cmaDescSize)
		errs[i] = cmaReadWithWord(pid, j.d, append([][]byte{heads[i][:min(n, cmaDescSize)]}, tail...))
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for i, j := range jobs {
		if errs[i] == nil {
			n := int(j.d.n)
			head, _ := splitHead(limit(j.r.userBufs(), n), cmaDescSize)
			scatter(head, heads[i][:min(n, cmaDescSize)])
		}
		r, err := j.r, errs[i]
		code := errCode(err)
		if !t.closed && err != ErrWithdrawn {
			t.cmaAck(r.peer, j.d.word, code)
		}
		switch {
		case err == nil:
			t.cma.recvd.Add(1)
		case err == ErrWithdrawn:
			err = withdrawnError("recv", r.peer, r.tag)
		case errors.Is(err, unix.ESRCH):
			err = &PeerLostError{Rank: r.peer, Op: "recv", Reason: "its process is gone (process_vm_readv: no such process)"}
		default:
			err = fmt.Errorf("transport: recv from rank %d tag %d: reading %d bytes from the sender's memory: %w", r.peer, r.tag, j.d.n, err)
		}
		if r.ov != nil && t.ov != nil && t.ovTransferDone(r, err) {
			continue
		}
		if err != nil {
			t.fail(r, err)
			continue
		}
		r.status = Status{Source: r.peer, Tag: r.tag, Size: int(j.d.n)}
		t.complete(r)
	}
}

// cmaReadWithWord reads the message of descriptor d from process pid into
// dst, then its validity word, in one process_vm_readv when it can. It
// returns ErrWithdrawn if the word no longer holds cmaValid.
//
// Why the bytes are then the message: the sender clears the word before it
// completes the send, and its application may write the buffer only after
// it saw the send complete; the kernel reads the word after the bytes (the
// ranges of one call are read in order, each range's pages are unpinned
// with a fully ordered atomic before the next range is read, and on x86
// loads are not reordered anyway). So a word still valid was read before
// the clear, and the bytes before it, before any write of the
// application's. A read that ends just after the clear reports the message
// withdrawn although its bytes were whole; the sender has reported failure
// either way.
func cmaReadWithWord(pid int, d cmaDesc, dst [][]byte) error {
	var w uint64
	dst = append(dst, unsafe.Slice((*byte)(unsafe.Pointer(&w)), 8))
	err := cmaReadv(pid, []unix.RemoteIovec{{Base: uintptr(d.addr), Len: int(d.n)}, {Base: uintptr(d.word), Len: 8}}, dst)
	if err == nil && w != cmaValid {
		return ErrWithdrawn
	}
	return err
}

// withdrawnError is the error of a receive whose sender withdrew its CMA
// message.
func withdrawnError(op string, peer, tag int) error {
	return fmt.Errorf("transport: %s from rank %d tag %d: %w (the sender's send failed, as when it closed its transport, before this rank read the message; its buffer is the sender's again)", op, peer, tag, ErrWithdrawn)
}

// errCode is the acknowledgement code of a read's outcome: 0, or an errno.
func errCode(err error) uint64 {
	var errno unix.Errno
	switch {
	case err == nil:
		return 0
	case errors.As(err, &errno):
		return uint64(errno)
	default:
		return uint64(unix.EIO)
	}
}

// limit returns the first n bytes of bufs.
// splitHead splits bufs into its first n bytes and the rest.
func splitHead(bufs [][]byte, n int) (head, tail [][]byte) {
	for i, b := range bufs {
		if n <= 0 {
			return head, append(tail, bufs[i:]...)
		}
		k := min(len(b), n)
		head = append(head, b[:k])
		n -= k
		if k < len(b) {
			tail = append(tail, b[k:])
		}
	}
	return head, tail
}

// limit cuts bufs down to their first n bytes.
func limit(bufs [][]byte, n int) [][]byte {
	out := make([][]byte, 0, len(bufs))
	for _, b := range bufs {
		if n <= 0 {
			break
		}
		b = b[:min(len(b), n)]
		out = append(out, b)
		n -= len(b)
	}
	return out
}

// cmaAck acknowledges descriptor id to rank peer; the worker lock is held.
func (t *Transport) cmaAck(peer int, id, code uint64) {
	p, err := t.peerLocked(peer, "cma-ack") // an AM's receiver may not be connected yet
	if err != nil {
		return // lost or closed: nobody waits for this acknowledgement
	}
	hdr := make([]byte, cmaAckSize)
	binary.LittleEndian.PutUint64(hdr[0:], id)
	binary.LittleEndian.PutUint64(hdr[8:], code)
	binary.LittleEndian.PutUint64(hdr[16:], uint64(t.rank))
	ureq, err := t.w.AMSend(p.ep, amCMAAck, hdr, ucx.Buffer{}, AMEager)
	if err != nil {
		t.log.Warn("sending a CMA acknowledgement failed", zap.Int("peer", peer), zap.Error(err))
		return
	}
	if ureq.Pending() {
		t.track(t.newRequest("cma-ack", peer, 0, 0), ureq, unsafe.Pointer(&hdr[0]))
	}
}

// cmaProbe is Iprobe's look at a USER wire tag; the worker lock is held.
// It reports the message's size if one is there. A descriptor is taken out
// of UCX (and held) to learn the real size; until it has arrived the probe
// reports nothing.
func (t *Transport) cmaProbe(wire uint64) (int, bool) {
	if d, ok := t.cma.held[wire]; ok {
		return int(d.n), true
	}
	_, info, ok := t.w.TagProbe(wire, t.userMask(), false)
	if !ok {
		return 0, false
	}
	if info.Tag&cmaBit == 0 {
		return info.Length, true
	}
	msg, _, ok := t.w.TagProbe(wire, t.userMask(), true)
	if !ok {
		return 0, false
	}
	buf := make([]byte, cmaDescSize)
	h := t.newRequest("cma-probe", -1, 0, cmaDescSize)
	t.cma.probing[wire] = nil
	h.probe = func(st ucx.Status, n int) {
		r := t.cma.probing[wire] // a receive posted while this was in flight
		delete(t.cma.probing, wire)
		src, tag, _ := SplitUserTag(wire)
		var d cmaDesc
		err := fmt.Errorf("transport: recv from rank %d tag %d: receiving its probed CMA descriptor: %w", src, tag, &ucx.Error{Op: "ucp_tag_msg_recv_nbx", Status: st})
		if st == ucx.StatusOK {
			d, err = decodeDesc(buf[:n], int(src), int(tag))
		}
		switch {
		case err != nil && r != nil:
			t.fail(r, err)
			return
		case err != nil:
			t.log.Warn("probed CMA descriptor lost", zap.Error(err))
			return
		case r != nil:
			t.cmaArrived(r, d)
			return
		}
		t.cma.held[wire] = d
		// A Probe may be parked until something arrives: this did.
		if t.arrival != nil {
			close(t.arrival)
			t.arrival = nil
		}
	}
	ureq, err := t.w.TagMsgRecv(ucx.Buffer{Ptr: unsafe.Pointer(&buf[0]), Len: cmaDescSize}, msg)
	if err != nil {
		t.log.Warn("receiving a probed CMA descriptor failed", zap.Error(err))
		return 0, false
	}
	if ureq.Pending() {
		t.track(h, ureq, unsafe.Pointer(&buf[0]))
		return 0, false
	}
	h.probe(ucx.StatusOK, cmaDescSize)
	d, ok := t.cma.held[wire]
	return int(d.n), ok
}

// cmaTakeHeld serves receive r from a held descriptor, if there is one for
// wire, or hands it to the probe still receiving that descriptor; the
// worker lock is held.
func (t *Transport) cmaTakeHeld(r *Request, wire uint64) bool {
	if q, ok := t.cma.probing[wire]; ok && q == nil {
		r.userRecv = true
		t.cma.probing[wire] = r
		return true
	}
	d, ok := t.cma.held[wire]
	if !ok {
		return false
	}
	delete(t.cma.held, wire)
	t.cmaArrived(r, d)
	return true
}

// cmaPeerLost fails the CMA sends to rank that wait for an
// acknowledgement; the worker lock is held.
func (t *Transport) cmaPeerLost(rank int, err error) {
	for id, r := range t.cma.sends {
		if r.peer == rank && !r.ureq.Pending() {
			delete(t.cma.sends, id)
			t.fail(r, err)
		}
	}
}

// cmaClose fails what CMA still has in flight; the worker lock is held.
func (t *Transport) cmaClose() {
	cmaWordsReturn(t.cma.words) // t.closed is set: later ones go straight back
	t.cma.words = nil
	for id, r := range t.cma.sends {
		delete(t.cma.sends, id)
		if !r.ureq.Pending() {
			t.fail(r, fmt.Errorf("transport: %s rank %d: %w", r.op, r.peer, ErrClosed))
		}
	}
	for _, j := range t.cma.jobs {
		t.fail(j.r, fmt.Errorf("transport: %s rank %d: %w", j.r.op, j.r.peer, ErrClosed))
	}
	t.cma.jobs = nil
	for wire, r := range t.cma.probing {
		delete(t.cma.probing, wire)
		if r != nil {
			t.fail(r, fmt.Errorf("transport: %s rank %d: %w", r.op, r.peer, ErrClosed))
		}
	}
}

// cmaAM is the receiver's view of an active message sent by CMA.
type cmaAM struct {
	d    cmaDesc
	from int
	amID uint16
}

// startCMAAM sends active message id with header, its data (r.b) staying
// in this process for the receiver to read; the worker lock is held.
func (t *Transport) startCMAAM(r *Request, id uint16, header []byte) {
	p, err := t.peerLocked(r.peer, "am-send")
	if err != nil {
		t.fail(r, err)
		return
	}
	c, err := t.cmaNewSend()
	if err != nil {
		t.fail(r, fmt.Errorf("transport: am-send rank %d: %w", r.peer, err))
		return
	}
	t.bundleFlush(r.peer) // posts before this send leave before it
	d := make([]byte, cmaAMSize)
	encodeDesc(d, uint64(uintptr(r.b.Ptr)), uint64(r.b.Len), c.id)
	binary.LittleEndian.PutUint64(d[32:], uint64(t.rank))
	binary.LittleEndian.PutUint64(d[40:], uint64(id))
	r.cma = c
	ureq, err := t.w.AMSend(p.ep, amCMAData, header, ucx.Buffer{Ptr: unsafe.Pointer(&d[0]), Len: len(d)}, AMEager)
	if err != nil {
		t.fail(r, fmt.Errorf("transport: am-send rank %d: %w", r.peer, err))
		return
	}
	t.cma.sends[c.id] = r
	t.cma.sent.Add(1)
	p.pending[r] = struct{}{}
	if ureq.Pending() {
		t.track(r, ureq, bytesPtr(header), unsafe.Pointer(&d[0]))
	}
}

// decodeCMAAM decodes the data of an amCMAData message.
func (t *Transport) decodeCMAAM(b []byte) (*cmaAM, error) {
	if len(b) != cmaAMSize {
		return nil, fmt.Errorf("%w: CMA active message with %d bytes of descriptor", ErrProtocol, len(b))
	}
	from := binary.LittleEndian.Uint64(b[32:])
	amID := binary.LittleEndian.Uint64(b[40:])
	if from >= uint64(t.size) || amID > 0xffff {
		return nil, fmt.Errorf("%w: CMA active message from rank %d for id %d", ErrProtocol, from, amID)
	}
	d, err := decodeDesc(b[:cmaDescSize], int(from), int(amID))
	if err != nil {
		return nil, err
	}
	return &cmaAM{d: d, from: int(from), amID: uint16(amID)}, nil
}

// cmaRecvAM reads m's data into dst in the calling goroutine, then
// acknowledges and completes r.
func (t *Transport) cmaRecvAM(m *AMMessage, r *Request, dst []byte) {
	c := m.cma
	err := error(unix.ESRCH)
	if t.cma.peers != nil && t.cma.peers[c.from] != nil {
		err = cmaReadWithWord(t.cma.peers[c.from].pid, cmaDesc{addr: c.d.addr, n: uint64(len(dst)), word: c.d.word}, [][]byte{dst})
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	code := errCode(err)
	if !t.closed && err != ErrWithdrawn {
		t.cmaAck(c.from, c.d.word, code)
	}
	if t.w != nil {
		m.ev.ReleaseData(t.w)
	}
	m.ev.FreeHeader()
	r.status.Size = len(dst)
	switch {
	case err == nil:
		t.cma.recvd.Add(1)
		t.complete(r)
	case err == ErrWithdrawn:
		t.fail(r, withdrawnError("am-recv", c.from, int(c.amID)))
	case errors.Is(err, unix.ESRCH):
		t.fail(r, &PeerLostError{Rank: c.from, Op: "am-recv", Reason: "its process is gone (process_vm_readv: no such process)"})
	default:
		t.fail(r, fmt.Errorf("transport: am-recv from rank %d: reading %d bytes from the sender's memory: %w", c.from, len(dst), err))
	}
}

// CMAStats reports same-host zero-copy use.
func (t *Transport) CMAStats() CMAStats {
	return CMAStats{Enabled: t.cma.on, Sent: t.cma.sent.Load(), Received: t.cma.recvd.Load(), Off: t.cma.off}
}
