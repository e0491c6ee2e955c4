package actor

import (
	pa "github.com/asynkron/protoactor-go/actor"
	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/transport"
)

// A device message whose bytes could not land on the receiver (a
// PostReceiveDevice buffer of the wrong size, no device memory, a failed
// copy) is undeliverable there. A sender actor that named itself (SendFrom,
// Request, RequestFuture) gets the *UndeliverableError with the reason, as
// for any undeliverable message; on the CUDA IPC path the sender's
// Completion fails too. A message sent without a sender (Send, a context's
// Send) on the staged path would leave its sending rank unaware, so the
// receiver tells that rank with an amDeviceRejected message: the sending
// rank counts it (Stats.DeviceRejected), logs it at warn level and
// publishes the *UndeliverableError as a dead letter on its own event
// stream.

// amDeviceRejected tells a rank that a device message it sent could not
// land.
const amDeviceRejected uint16 = 0x46

// rejectDevice tells rank r that its message to target could not land.
func (rt *Runtime) rejectDevice(r int, target *pa.PID, reason string) {
	if r == rt.rank {
		rt.deviceRejected(target, reason)
		return
	}
	reason = clipReason(reason)
	hdr := appendString(appendString(appendUint(nil, uint64(rt.rank)), target.Id), reason)
	if _, err := rt.t.SendAM(r, amDeviceRejected, hdr, nil, transport.AMEager); err != nil {
		rt.log.Debug("device rejection not sent", zap.Int("peer", r), zap.Error(err))
	}
}

// onDeviceRejected (sending rank) takes a receiver's rejection.
func (rt *Runtime) onDeviceRejected(m *transport.AMMessage) {
	src, target, reason, err := decodeDeviceRejected(m.Header, rt.size)
	if err != nil {
		rt.stats.DecodeErrors.Add(1)
		rt.log.Warn("malformed device rejection", zap.Binary("header", m.Header), zap.Error(err))
		return
	}
	rt.deviceRejected(rt.PID(src, target), reason)
}

// deviceRejected records that a device message to target could not land.
func (rt *Runtime) deviceRejected(target *pa.PID, reason string) {
	rt.stats.DeviceRejected.Add(1)
	rt.log.Warn("a device message sent without a sender could not land", zap.Stringer("to", target), zap.String("reason", reason))
	ue := &UndeliverableError{Target: target.String(), Reason: reason}
	rt.sys.EventStream.Publish(&pa.DeadLetterEvent{PID: target, Message: ue})
}
