package transport

import "fmt"

// Kind is the traffic class in the top four bits of every 64-bit UCX tag
// (DESIGN 5.2).
type Kind uint8

// Traffic kinds.
const (
	KindDevice  Kind = 1 // device (GPU) payloads of actor messages
	KindChannel Kind = 2 // channel traffic (per-channel counters)
	KindDDT     Kind = 3 // derived-datatype fields of runtimes' messages (TypedOptions.Runtime): RTS tags laid out as KindTyped's
	KindCtrl    Kind = 4 // runtime control traffic
	KindUser    Kind = 5 // the MPI-style tagged API
	KindTyped   Kind = 6 // typed (datatype) transfers of the MPI-style API; layout in noncontig_wire.go
	// KindChannelCtl is KindChannel with the top bit set: a channel
	// message's control message (a header, or a CUDA IPC descriptor) under
	// the message's own channel id and counter (channel_ipc.go).
	KindChannelCtl Kind = KindChannel | 8
	// KindChannelAck: a receiver's acknowledgement of a CUDA IPC
	// descriptor, laid out as CHANNEL tags (channel_ipc.go).
	KindChannelAck Kind = 11
)

// Layout of the tag fields. DEVICE/DDT/CTRL traffic: kind(4) | source rank(32) |
// per-source counter(28). CHANNEL: kind(4) | channel id(28) | per-channel-end
// counter(32). USER (MPI-style API): kind(4) | source rank(24) | user tag(16) |
// per-(source, tag) sequence number(20); the user tag must be in the wire tag
// for trace-based matching to tell two tags' sequences apart, so the source
// field is narrower than for the other kinds.
const (
	kindShift = 60

	SourceBits  = 32
	CounterBits = 28

	ChannelBits        = 28
	ChannelCounterBits = 32

	UserSourceBits = 24
	UserTagBits    = 16
	UserSeqBits    = 20

	// MaxUserTag is the largest tag the MPI-style API accepts (MPI_TAG_UB).
	MaxUserTag = 1<<UserTagBits - 1
	// MaxUserRanks is the largest job the MPI-style API addresses.
	MaxUserRanks = 1 << UserSourceBits

	counterMask        = 1<<CounterBits - 1
	channelCounterMask = 1<<ChannelCounterBits - 1
	userSeqMask        = 1<<UserSeqBits - 1

	// FullMask matches every bit of a tag.
	FullMask = ^uint64(0)
)

// MakeTag builds a DEVICE, DDT or CTRL tag; the counter wraps at 2^28.
func MakeTag(k Kind, source uint32, counter uint32) uint64 {
	return uint64(k)<<kindShift | uint64(source)<<CounterBits | uint64(counter&counterMask)
}

// SplitTag is the inverse of MakeTag.
func SplitTag(tag uint64) (k Kind, source uint32, counter uint32) {
	return Kind(tag >> kindShift), uint32(tag >> CounterBits), uint32(tag & counterMask)
}

// MakeChannelTag builds a CHANNEL tag; the channel id must fit 28 bits.
func MakeChannelTag(channel uint32, counter uint32) (uint64, error) {
	if channel >= 1<<ChannelBits {
		return 0, fmt.Errorf("transport: channel id %d does not fit %d bits", channel, ChannelBits)
	}
	return uint64(KindChannel)<<kindShift | uint64(channel)<<ChannelCounterBits | uint64(counter), nil
}

// SplitChannelTag is the inverse of MakeChannelTag.
func SplitChannelTag(tag uint64) (channel uint32, counter uint32) {
	return uint32(tag>>ChannelCounterBits) & (1<<ChannelBits - 1), uint32(tag & channelCounterMask)
}

// MakeUserTag builds a tag of the MPI-style API: source rank, user tag and the
// per-(source, tag) sequence number, which wraps at 2^20.
func MakeUserTag(source uint32, tag uint16, seq uint32) uint64 {
	return uint64(KindUser)<<kindShift |
		uint64(source&(MaxUserRanks-1))<<(UserTagBits+UserSeqBits) |
		uint64(tag)<<UserSeqBits |
		uint64(seq&userSeqMask)
}

// SplitUserTag is the inverse of MakeUserTag.
func SplitUserTag(t uint64) (source uint32, tag uint16, seq uint32) {
	return uint32(t>>(UserTagBits+UserSeqBits)) & (MaxUserRanks - 1), uint16(t >> UserSeqBits), uint32(t & userSeqMask)
}
