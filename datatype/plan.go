package datatype

import (
	"fmt"
	"strings"
	"time"
)

// This file holds the pure planning half of troupe's noncontiguous transfer
// schemes (DESIGN 6): which scheme a layout should use, the chunk size two
// peers agree on, the windows a layout is cut into and the moves that carry
// one layout's bytes into another's. transport executes the plans; nothing
// here does I/O.

// Scheme is a transfer scheme for a (buffer, datatype, count) payload.
type Scheme uint8

// Transfer schemes.
const (
	// SchemeAuto is the layout-aware adaptive default: host pack until the
	// layout is registered, then zero-copy for layouts with large blocks.
	SchemeAuto Scheme = iota
	// SchemePack packs into pooled buffers, sends them and unpacks.
	SchemePack
	// SchemeSGL hands scatter/gather lists (UCP IOV datatype) to UCX on
	// both sides, chunked by a maximum number of entries per operation.
	SchemeSGL
	// SchemeZCopy writes straight into the receiver's memory through
	// registered windows (UMR-style).
	SchemeZCopy
)

var schemeNames = [...]string{"adaptive", "pack", "sgl", "zcopy"}

// String returns the scheme's name as used in counters, flags and JSON:
// "adaptive", "pack", "sgl" or "zcopy".
func (s Scheme) String() string {
	if int(s) < len(schemeNames) {
		return schemeNames[s]
	}
	return fmt.Sprintf("scheme(%d)", uint8(s))
}

// ParseScheme parses a scheme name ("adaptive" or "auto", "pack", "sgl",
// "zcopy").
func ParseScheme(name string) (Scheme, error) {
	switch strings.ToLower(strings.TrimSpace(name)) {
	case "adaptive", "auto", "":
		return SchemeAuto, nil
	case "pack":
		return SchemePack, nil
	case "sgl":
		return SchemeSGL, nil
	case "zcopy":
		return SchemeZCopy, nil
	}
	return 0, invalid("unknown transfer scheme %q (want adaptive, pack, sgl or zcopy)", name)
}

// DataBounds returns the byte range [lo, hi) relative to the origin that
// count elements of t touch (true lb to true ub of the whole payload); both
// are 0 when there is no data.
func (t *Type) DataBounds(count int64) (lo, hi int64, err error) {
	nd, err := t.program(count)
	if err != nil || nd == nil {
		return 0, 0, err
	}
	return nd.lo, nd.hi, nil
}

// Thresholds steer the layout-aware adaptive scheme (Algorithms 1 and 2 of
// the layout-aware paper, and the hybrid UMR rule of the UMR paper).
type Thresholds struct {
	// ZCopyAvgBlock is T: a registered layout whose average block is
	// larger goes hardware-assisted (SGL or windows); smaller goes pack.
	ZCopyAvgBlock int64
	// WindowMaxSegments and WindowMinBlock bound the layouts that use
	// UMR-style windows: at most this many segments and every block at
	// least this long. Other hardware-assisted layouts use SGL.
	WindowMaxSegments int64
	WindowMinBlock    int64
	// SGLMaxSegments: hardware-assisted layouts with more segments go
	// pack instead of SGL.
	SGLMaxSegments int64
	// MaxIOVsPerOp is MAX_IOVS_PER_OP: the agreed chunk is this many times
	// the smaller of both sides' minimum block lengths.
	MaxIOVsPerOp int
	// CrossoverBand: layouts whose average block lies within
	// [T/CrossoverBand, T*CrossoverBand] have the pack/SGL crossover
	// measured per layout pair (Crossover) instead of assumed at T; 0 or 1
	// turns measuring off. On by default (4): T is right for some machines
	// and wrong for others (docs/noncontig.md).
	// CrossoverTrials: timed transfers per scheme before the verdict.
	// CrossoverRun: the trials go in runs of this many transfers of one
	// scheme (pack, SGL, SGL, pack, ...), the first after each change of
	// scheme not timed; 1 times every transfer (docs/noncontig.md).
	CrossoverBand   int64
	CrossoverTrials int
	CrossoverRun    int
	// CrossoverReuse: how long after it was measured a verdict is taken
	// for other buffers of the same layout shapes without trials of
	// their own; later pairs are measured afresh, because what a shared
	// machine favours drifts over minutes (docs/noncontig.md). A pair
	// keeps the verdict it took or measured. 0: reused for as long as it
	// is kept.
	CrossoverReuse time.Duration
}

// MaxCrossoverTrials bounds Thresholds.CrossoverTrials and CrossoverRun:
// more trials than this would keep a layout pair measuring for tens of
// thousands of transfers, and CrossoverTransfers walks them all.
const MaxCrossoverTrials = 1 << 12

// DefaultThresholds returns the defaults measured on troupe's reference
// machine (docs/noncontig.md): T = 8 KiB; windows up to 128 segments (the
// UMR paper's bound) but only for blocks of 32 KiB and more, because without
// UMR a window write costs a put per block (the UMR paper's 512 B assumes
// one hardware operation per window).
func DefaultThresholds() Thresholds {
	return Thresholds{
		ZCopyAvgBlock:     8 << 10,
		WindowMaxSegments: 128,
		WindowMinBlock:    32 << 10,
		SGLMaxSegments:    1 << 16,
		MaxIOVsPerOp:      16,
		CrossoverBand:     4, // [T/4, T*4]: see docs/noncontig.md
		CrossoverTrials:   8,
		CrossoverRun:      4,
		CrossoverReuse:    time.Second,
	}
}

// Validate reports thresholds that cannot work.
func (th Thresholds) Validate() error {
	switch {
	case th.ZCopyAvgBlock < 0:
		return invalid("Thresholds: negative ZCopyAvgBlock %d", th.ZCopyAvgBlock)
	case th.WindowMaxSegments < 0 || th.WindowMinBlock < 0 || th.SGLMaxSegments < 0:
		return invalid("Thresholds: negative window or SGL bound")
	case th.MaxIOVsPerOp < 1:
		return invalid("Thresholds: MaxIOVsPerOp %d < 1", th.MaxIOVsPerOp)
	case th.CrossoverBand < 0 || th.CrossoverTrials < 0 || th.CrossoverRun < 0:
		return invalid("Thresholds: negative CrossoverBand %d, CrossoverTrials %d or CrossoverRun %d", th.CrossoverBand, th.CrossoverTrials, th.CrossoverRun)
	case th.CrossoverTrials > MaxCrossoverTrials || th.CrossoverRun > MaxCrossoverTrials:
		return invalid("Thresholds: CrossoverTrials %d or CrossoverRun %d above %d", th.CrossoverTrials, th.CrossoverRun, MaxCrossoverTrials)
	case th.CrossoverReuse < 0:
		return invalid("Thresholds: negative CrossoverReuse %v", th.CrossoverReuse)
	}
	return nil
}

// SelectLocal is one side's choice for a layout with statistics st (Algorithm
// 1, SelectLocalScheme): known says the layout was used before (a layout
// cache hit), registered that its memory is registered. The first use of a
// layout always goes pack; wantRegistration then says whether the layout is
// worth registering in the background (its average block exceeds T).
// Registered layouts above T go zero-copy when they fit the window bounds,
// else SGL, else pack.
func (th Thresholds) SelectLocal(st Stats, known, registered bool) (s Scheme, wantRegistration bool) {
	large := st.Segments > 0 && st.AvgBlock > float64(th.ZCopyAvgBlock)
	if !known || !registered {
		return SchemePack, large && !registered
	}
	if !large {
		return SchemePack, false
	}
	if st.Segments <= th.WindowMaxSegments && st.MinBlock >= th.WindowMinBlock {
		return SchemeZCopy, false
	}
	if st.Segments <= th.SGLMaxSegments {
		return SchemeSGL, false
	}
	return SchemePack, false
}

// Agree is the receiver's decision (Algorithm 1, RTS handler) from the
// sender's proposal and its own local choice, neither of them SchemeAuto:
// pack if either side wants pack, zero-copy only if both want it, SGL
// otherwise.
func Agree(proposal, local Scheme) Scheme {
	switch {
	case proposal == SchemePack || local == SchemePack:
		return SchemePack
	case proposal == SchemeZCopy && local == SchemeZCopy:
		return SchemeZCopy
	default:
		return SchemeSGL
	}
}

// AgreeChunk returns the chunk both sides cut their layouts into: maxIOVs
// times the smaller of the two minimum block lengths (the UMR paper's
// csize = MAX_IOVS_PER_WQE x min(S_blockmin, R_blockmin)). A side with no
// data reports a minimum of 0 and is ignored; the chunk is at least 1.
func AgreeChunk(maxIOVs int, senderMin, receiverMin int64) (int64, error) {
	if maxIOVs < 1 {
		return 0, invalid("AgreeChunk: maxIOVs %d < 1", maxIOVs)
	}
	if senderMin < 0 || receiverMin < 0 {
		return 0, invalid("AgreeChunk: negative minimum block (%d, %d)", senderMin, receiverMin)
	}
	m := senderMin
	if m == 0 || (receiverMin > 0 && receiverMin < m) {
		m = receiverMin
	}
	m = max(m, 1)
	var a arith
	c := a.mul(int64(maxIOVs), m, "chunk size")
	if err := a.err(); err != nil {
		return 0, err
	}
	return c, nil
}

// Window is one chunk of a layout: packed bytes [Off, Off+Len) of the
// payload, which lie in blocks First..Last of the layout's IOV list (the
// first one entered Skip bytes in). A window holds blocks only, never the
// gaps between them; Addr and End bound the memory its blocks span, which is
// what a window registration must cover.
type Window struct {
	Off, Len    int64
	First, Last int
	Skip        int64
	Addr, End   uintptr
}

// Windows cuts a layout (its IOVs in packed order) into windows of chunk
// packed bytes each (the last may be shorter), the UMR paper's sliding
// window. Zero-length IOVs are skipped. Both peers cut with the same chunk,
// so window k of the sender and window k of the receiver carry the same
// packed bytes. A window of chunk = MaxIOVsPerOp x minimum block touches at
// most MaxIOVsPerOp+1 blocks (one more when it starts inside a block).
func Windows(iovs []IOV, chunk int64) ([]Window, error) {
	if chunk < 1 {
		return nil, invalid("Windows: chunk %d < 1", chunk)
	}
	var out []Window
	var w Window
	open := false
	var off int64 // packed offset at the start of the current IOV position
	for i := 0; i < len(iovs); i++ {
		v := iovs[i]
		if v.Len < 0 {
			return nil, invalid("Windows: IOV %d has negative length %d", i, v.Len)
		}
		var done int64 // bytes of v already placed in earlier windows
		for done < v.Len {
			at := v.Addr + uintptr(done)
			if !open {
				w = Window{Off: off, First: i, Skip: done, Addr: at, End: at}
				open = true
			}
			take := min(v.Len-done, chunk-w.Len)
			w.Len += take
			w.Last = i
			// The IOVs need not ascend (negative strides, structs in any
			// order): the bounds are the lowest and highest of the pieces.
			w.Addr = min(w.Addr, at)
			w.End = max(w.End, at+uintptr(take))
			done += take
			off += take
			if w.Len == chunk {
				out = append(out, w)
				open = false
			}
		}
	}
	if open {
		out = append(out, w)
	}
	return out, nil
}

// Pieces appends the memory pieces of window w of layout iovs to dst: the
// parts of blocks First..Last that hold its packed bytes, in packed order.
func (w Window) Pieces(iovs []IOV, dst []IOV) []IOV {
	left := w.Len
	for i := w.First; i <= w.Last && left > 0 && i < len(iovs); i++ {
		v := iovs[i]
		var skip int64
		if i == w.First {
			skip = w.Skip
		}
		n := min(v.Len-skip, left)
		if n <= 0 {
			continue
		}
		dst = append(dst, IOV{Addr: v.Addr + uintptr(skip), Len: n})
		left -= n
	}
	return dst
}

// Move is one contiguous copy of a transfer: Len bytes from Src (sender
// memory) to Dst (receiver memory).
type Move struct {
	Src, Dst uintptr
	Len      int64
}

// Moves appends to dst the moves that carry the bytes of the sender's
// pieces src into the receiver's pieces rcv, pairing them in packed order
// (each move is the overlap of one sender piece and one receiver piece). Both
// lists must hold the same number of bytes, and no piece a negative number.
func Moves(src, rcv []IOV, dst []Move) ([]Move, error) {
	for i, v := range src {
		if v.Len < 0 {
			return dst, invalid("Moves: sender piece %d has negative length %d", i, v.Len)
		}
	}
	for j, v := range rcv {
		if v.Len < 0 {
			return dst, invalid("Moves: receiver piece %d has negative length %d", j, v.Len)
		}
	}
	i, j := 0, 0
	var si, rj int64 // bytes consumed of src[i], rcv[j]
	for i < len(src) && j < len(rcv) {
		a, b := src[i], rcv[j]
		n := min(a.Len-si, b.Len-rj)
		if n > 0 {
			dst = append(dst, Move{Src: a.Addr + uintptr(si), Dst: b.Addr + uintptr(rj), Len: n})
		}
		si += n
		rj += n
		if si >= a.Len {
			i, si = i+1, 0
		}
		if rj >= b.Len {
			j, rj = j+1, 0
		}
	}
	for ; i < len(src); i, si = i+1, 0 {
		if src[i].Len-si > 0 {
			return dst, invalid("Moves: sender pieces hold more bytes than the receiver's")
		}
	}
	for ; j < len(rcv); j, rj = j+1, 0 {
		if rcv[j].Len-rj > 0 {
			return dst, invalid("Moves: receiver pieces hold more bytes than the sender's")
		}
	}
	return dst, nil
}

// Chunks returns how many pieces of chunk bytes (the last may be shorter)
// total bytes make: the number of messages of a pipelined pack transfer.
func Chunks(total, chunk int64) int64 {
	if total <= 0 || chunk <= 0 {
		return 0
	}
	return total/chunk + min(total%chunk, 1) // (total+chunk-1)/chunk overflowed
}
