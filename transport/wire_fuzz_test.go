package transport

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"testing"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
)

// Fuzz targets of the transport's decoders of bytes from a peer: the typed
// protocol's RTS, CTS (and ACK) and window keys, the CMA descriptor and
// CMA active-message descriptor, the channel IPC control message (the
// device IPC descriptor), remote keys and the start-up host entry. Each
// checks: no panic; on success the decoded values are in the documented
// ranges and encoding them again gives back the input (reserved bytes,
// which the decoders ignore, aside); on failure the documented error.

// FuzzRTSDecode: a decoded RTS is within bounds and re-encodes to its
// input; every failure is ErrInvalid.
func FuzzRTSDecode(f *testing.F) {
	for _, m := range []rts{
		{proposal: datatype.SchemeSGL, flags: rtsCrossover, xid: 77, bytes: 65536,
			sig:      datatype.Signature{Elements: 8192, Hash: [2]uint64{0x0123456789abcdef, 0xfedcba9876543210}},
			minBlock: 4096, segments: 16, chunk: 131072, rtt: 2345},
		{proposal: datatype.SchemeZCopy, xid: ncXidMask, bytes: 1 << 40, minBlock: 1 << 20, segments: 1 << 20, chunk: maxWireChunk},
		{proposal: datatype.SchemePack, flags: rtsInline, bytes: 3, chunk: 1},
	} {
		n := rtsHdrLen
		if m.flags&rtsInline != 0 {
			n += int(m.bytes)
		}
		b := make([]byte, n)
		m.encode(b)
		f.Add(b)
	}
	f.Add([]byte{ncVersion})
	f.Fuzz(func(t *testing.T, b []byte) {
		var m rts
		err := m.decode(b)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v is not ErrInvalid", err)
			}
			return
		}
		switch {
		case m.proposal < datatype.SchemePack || m.proposal > datatype.SchemeZCopy:
			t.Fatalf("accepted scheme %d", m.proposal)
		case m.bytes < 0 || m.minBlock < 0 || m.segments < 0:
			t.Fatalf("accepted negative sizes: %+v", m)
		case m.chunk < 1 || m.chunk > maxWireChunk:
			t.Fatalf("accepted chunk %d", m.chunk)
		case datatype.Chunks(m.bytes, m.chunk) > 1<<32:
			t.Fatalf("accepted %d chunks", datatype.Chunks(m.bytes, m.chunk))
		case m.flags&rtsInline != 0 && int64(len(b)-rtsHdrLen) != m.bytes:
			t.Fatalf("inline RTS of %d bytes says %d", len(b)-rtsHdrLen, m.bytes)
		}
		out := make([]byte, rtsHdrLen)
		m.encode(out)
		in := append([]byte(nil), b[:rtsHdrLen]...)
		in[3] = 0               // reserved
		clear(in[68:rtsHdrLen]) // reserved
		if !bytes.Equal(out, in) {
			t.Fatalf("re-encoded %x, input %x", out, in)
		}
	})
}

// FuzzCTSDecode: a decoded CTS (or ACK) has a known status, a scheme when
// it clears the transfer, bounded key length and chunk, and re-encodes to
// its input; every failure is ErrInvalid.
func FuzzCTSDecode(f *testing.F) {
	sig := datatype.Signature{Elements: 4096, Hash: [2]uint64{1, 2}}
	for _, m := range []cts{
		{status: stOK, scheme: datatype.SchemeSGL, flags: ctsVerdict, chunk: 4096, rbytes: 65536},
		{status: stOK, scheme: datatype.SchemeZCopy, flags: ctsKeys, nwin: 16, chunk: 1 << 20, setID: 42, keysLen: 4096, rbytes: 1 << 24},
		{status: stOK, scheme: datatype.SchemePack, rbytes: 8},
		{status: stMismatch, rbytes: 64, rsig: sig},
		{status: stTooSmall, rbytes: 32},
		{status: stFailed},
	} {
		b := make([]byte, ctsLen)
		m.encode(b)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var m cts
		err := m.decode(b)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v is not ErrInvalid", err)
			}
			return
		}
		switch {
		case m.status > stFailed:
			t.Fatalf("accepted status %d", m.status)
		case m.status == stOK && (m.scheme < datatype.SchemePack || m.scheme > datatype.SchemeZCopy):
			t.Fatalf("accepted scheme %d", m.scheme)
		case m.keysLen < 0 || m.keysLen > 1<<34 || m.chunk < 0 || m.rbytes < 0:
			t.Fatalf("accepted sizes out of range: %+v", m)
		}
		out := make([]byte, ctsLen)
		m.encode(out)
		in := append([]byte(nil), b...)
		in[3] = 0 // reserved
		if !bytes.Equal(out, in) {
			t.Fatalf("re-encoded %x, input %x", out, in)
		}
	})
}

// encodeKeyBlob writes rs as windowSet.keyBlob does.
func encodeKeyBlob(id uint64, rs *remoteSet) []byte {
	le := binary.LittleEndian
	b := le.AppendUint64(nil, id)
	b = le.AppendUint32(b, uint32(len(rs.wins)))
	b = le.AppendUint32(b, uint32(len(rs.rkey)))
	b = append(b, rs.rkey...)
	for _, ps := range rs.wins {
		b = le.AppendUint32(b, uint32(len(ps)))
		for _, p := range ps {
			b = le.AppendUint64(b, uint64(p.Addr))
			b = le.AppendUint64(b, uint64(p.Len))
		}
	}
	return b
}

// FuzzKeyBlob: decoded window keys have a registration key and no
// negative piece, and re-encode to their input; every failure is
// ErrInvalid.
func FuzzKeyBlob(f *testing.F) {
	iovs := []datatype.IOV{{Addr: 0x1000, Len: 64}, {Addr: 0x2000, Len: 64}, {Addr: 0x3000, Len: 128}}
	wins, err := datatype.Windows(iovs, 96)
	if err != nil {
		f.Fatal(err)
	}
	ws := &windowSet{id: 7, wins: wins, rkey: []byte("packed-rkey")}
	f.Add(ws.keyBlob(iovs), uint64(7))
	f.Add(encodeKeyBlob(9, &remoteSet{rkey: []byte{1}}), uint64(9))
	f.Add(encodeKeyBlob(3, &remoteSet{rkey: []byte{1, 2}, wins: [][]datatype.IOV{{}, {{Addr: math.MaxUint64, Len: math.MaxInt64}}}}), uint64(3))
	f.Fuzz(func(t *testing.T, b []byte, want uint64) {
		rs, err := decodeKeyBlob(b, want)
		if err != nil {
			if rs != nil || !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v (set %v) is not ErrInvalid alone", err, rs)
			}
			return
		}
		if len(rs.rkey) == 0 {
			t.Fatal("accepted an empty registration key")
		}
		for w, ps := range rs.wins {
			for _, p := range ps {
				if p.Len < 0 {
					t.Fatalf("window %d: accepted piece %+v", w, p)
				}
			}
		}
		if out := encodeKeyBlob(want, rs); !bytes.Equal(out, b) {
			t.Fatalf("re-encoded %x, input %x", out, b)
		}
	})
}

// FuzzCMADesc: a decoded CMA descriptor (alone or in an active message)
// has a size below 2^63 and an aligned validity word, and re-encodes to
// its input; every failure is ErrProtocol.
func FuzzCMADesc(f *testing.F) {
	const size = 4
	am := func(addr, n, word, from, id uint64) []byte {
		b := make([]byte, cmaAMSize)
		encodeDesc(b, addr, n, word)
		binary.LittleEndian.PutUint64(b[32:], from)
		binary.LittleEndian.PutUint64(b[40:], id)
		return b
	}
	d := make([]byte, cmaDescSize)
	encodeDesc(d, 0x7f0000001000, 1<<20, 0x7f0000002008)
	f.Add(d)
	f.Add(am(0x7f0000001000, 4096, 0x1008, 3, 0x41))
	f.Add(am(0, math.MaxInt64, 8, 0, 0xffff))
	tr := &Transport{size: size}
	check := func(t *testing.T, d cmaDesc, b []byte) {
		t.Helper()
		if d.n > math.MaxInt64 || d.word == 0 || d.word%8 != 0 {
			t.Fatalf("accepted descriptor %+v", d)
		}
		out := make([]byte, cmaDescSize)
		encodeDesc(out, d.addr, d.n, d.word)
		if !bytes.Equal(out, b) {
			t.Fatalf("re-encoded %x, input %x", out, b)
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if d, err := decodeDesc(b, 1, 2); err != nil {
			if !errors.Is(err, ErrProtocol) {
				t.Fatalf("descriptor: error %v is not ErrProtocol", err)
			}
		} else {
			check(t, d, b)
		}
		m, err := tr.decodeCMAAM(b)
		if err != nil {
			if m != nil || !errors.Is(err, ErrProtocol) {
				t.Fatalf("active message: error %v (message %v) is not ErrProtocol alone", err, m)
			}
			return
		}
		if m.from < 0 || m.from >= size {
			t.Fatalf("accepted rank %d of %d", m.from, size)
		}
		check(t, m.d, b[:cmaDescSize])
		if binary.LittleEndian.Uint64(b[32:]) != uint64(m.from) || binary.LittleEndian.Uint64(b[40:]) != uint64(m.amID) {
			t.Fatalf("decoded rank %d id %d from %x", m.from, m.amID, b[32:])
		}
	})
}

// FuzzIPCDesc: a decoded channel control message has a known kind; an IPC
// descriptor lies within its allocation and has a length an int holds
// (DeviceDescLength's result), and re-encodes to its input; every failure
// is ErrProtocol.
func FuzzIPCDesc(f *testing.F) {
	h := gpu.IPCHandle{Offset: 256, Length: 1024, Size: 1 << 20}
	copy(h.Handle[:], "driver handle bytes")
	f.Add((&ipcDesc{kind: ctlIPC, length: 1024, h: h, base: 0x7f0000000000}).encode())
	f.Add((&ipcDesc{kind: ctlHeader, length: 4096}).encode())
	full := gpu.IPCHandle{Offset: 0, Size: math.MaxUint64}
	f.Add((&ipcDesc{kind: ctlIPC, length: math.MaxInt64, h: full}).encode())
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := decodeIPCDesc(b)
		n, lerr := DeviceDescLength(b)
		if err != nil {
			if !errors.Is(err, ErrProtocol) {
				t.Fatalf("error %v is not ErrProtocol", err)
			}
			if !errors.Is(lerr, ErrProtocol) || n != 0 {
				t.Fatalf("DeviceDescLength = %d, %v for a malformed descriptor", n, lerr)
			}
			return
		}
		switch d.kind {
		case ctlHeader:
			if !errors.Is(lerr, ErrProtocol) || n != 0 {
				t.Fatalf("DeviceDescLength = %d, %v for a header", n, lerr)
			}
		case ctlIPC:
			if d.h.Size == 0 || d.h.Offset > d.h.Size || d.length > d.h.Size-d.h.Offset || d.h.Length != d.length {
				t.Fatalf("accepted descriptor %+v", d)
			}
			if lerr != nil || n < 0 || uint64(n) != d.length {
				t.Fatalf("DeviceDescLength = %d, %v for a descriptor of %d bytes", n, lerr, d.length)
			}
		default:
			t.Fatalf("accepted kind %d", d.kind)
		}
		if d.length > math.MaxInt64 {
			t.Fatalf("accepted length %d", d.length)
		}
		if out := d.encode(); !bytes.Equal(out, b) {
			t.Fatalf("re-encoded %x, input %x", out, b)
		}
	})
}

// FuzzRemoteKey: a decoded remote key has packed bytes and a length in
// range, and marshals back to its input; every failure is ErrInvalid.
func FuzzRemoteKey(f *testing.F) {
	for _, k := range []RemoteKey{
		{Rank: 3, Addr: 0x7f0000001000, Len: 1 << 20, Packed: []byte("packed rkey bytes")},
		{Rank: 0, Addr: 0, Len: 0, Packed: []byte{1}},
		{Rank: math.MaxUint32, Addr: math.MaxUint64, Len: 1 << 62, Packed: bytes.Repeat([]byte{0xff}, 300)},
	} {
		b, _ := k.MarshalBinary()
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var k RemoteKey
		if err := k.UnmarshalBinary(b); err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v is not ErrInvalid", err)
			}
			return
		}
		if len(k.Packed) == 0 || k.Len < 0 || k.Len > 1<<62 || k.Rank < 0 {
			t.Fatalf("accepted key %+v", k)
		}
		if out, _ := k.MarshalBinary(); !bytes.Equal(out, b) {
			t.Fatalf("re-encoded %x, input %x", out, b)
		}
	})
}

// encodeHostInfo writes p as hostInfo does.
func encodeHostInfo(p peerHost) []byte {
	b := []byte{p.flags}
	b = binary.LittleEndian.AppendUint64(b, p.pid)
	b = binary.LittleEndian.AppendUint64(b, p.addr)
	b = binary.LittleEndian.AppendUint64(b, p.word)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(p.cpus)))
	b = append(b, p.cpus...)
	return append(b, p.node...)
}

// FuzzHostInfo: a host entry read has a process id the kernel could have
// given (1 to 2^31-1: process_vm_readv takes a pid_t) and re-encodes to its
// input; an entry it refuses is one too short for its lengths or with such
// a process id.
func FuzzHostInfo(f *testing.F) {
	f.Add(hostInfo(true, false))
	f.Add(hostInfo(true, true))
	f.Add(encodeHostInfo(peerHost{flags: infoCMA, pid: 1, addr: 8, word: 1, node: "node"}))
	f.Add(encodeHostInfo(peerHost{pid: math.MaxInt32, cpus: []byte{0xff, 0x0f}}))
	f.Fuzz(func(t *testing.T, b []byte) {
		p, ok := parseHostInfo(b)
		if !ok {
			if len(b) >= 27 && len(b) >= 27+int(binary.LittleEndian.Uint16(b[25:])) {
				if pid := binary.LittleEndian.Uint64(b[1:]); pid >= 1 && pid <= math.MaxInt32 {
					t.Fatalf("refused a well-formed entry of pid %d", pid)
				}
			}
			return
		}
		if p.pid < 1 || p.pid > math.MaxInt32 {
			t.Fatalf("accepted pid %d", p.pid)
		}
		if out := encodeHostInfo(p); !bytes.Equal(out, b) {
			t.Fatalf("re-encoded %x, input %x", out, b)
		}
	})
}
