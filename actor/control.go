package actor

import "fmt"

// Decoders of the runtime's control messages: the active-message headers
// that return credits and answer device messages. Each reads the header a
// peer sent and checks the rank it names against the job's size; every
// failure is a *DecodeError. The handlers (onCredit, onDeviceAck,
// onDeviceResend, onDeviceBytes, onDeviceRejected) count and log it.

// decodeCredit reads a credit message: the rank returning credits and how
// many (appendUint twice, inPeer.credit).
func decodeCredit(b []byte, size int) (src int, n uint64, err error) {
	r := &wireReader{b: b}
	s, n := r.uint(), r.uint()
	r.end()
	if err := checkRank(r, s, size); err != nil {
		return 0, 0, err
	}
	return int(s), n, nil
}

// decodeDeviceReply reads the header of a device acknowledgement
// (ackDevice), a request for the bytes of a declined device message
// (fetchDeclined) or those bytes' header (resendBytes): the sending rank,
// the message's sequence number and a reason ("" for none), cut to
// maxAckReason bytes as its sender would have.
func decodeDeviceReply(b []byte, size int) (src int, seq uint64, reason string, err error) {
	r := &wireReader{b: b}
	s, seq := r.uint(), r.uint()
	reason = r.string()
	r.end()
	if err := checkRank(r, s, size); err != nil {
		return 0, 0, "", err
	}
	return int(s), seq, clipReason(reason), nil
}

// decodeDeviceRejected reads a device rejection (rejectDevice): the
// rejecting rank, the target actor's id and the reason, cut to
// maxAckReason bytes as its sender would have.
func decodeDeviceRejected(b []byte, size int) (src int, target, reason string, err error) {
	r := &wireReader{b: b}
	s := r.uint()
	target, reason = r.string(), r.string()
	r.end()
	if err := checkRank(r, s, size); err != nil {
		return 0, "", "", err
	}
	return int(s), target, clipReason(reason), nil
}

// checkRank returns the reader's error, or a *DecodeError when rank names
// no rank of a job of size ranks.
func checkRank(r *wireReader, rank uint64, size int) error {
	if r.err != nil {
		return r.err
	}
	if rank >= uint64(size) {
		return &DecodeError{Offset: 0, Reason: fmt.Sprintf("rank %d of a job of %d", rank, size)}
	}
	return nil
}
