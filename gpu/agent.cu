// agent.cu: troupe's resident copy agent (agent.go). agent.ptx is generated
// from this file by `make ptx` (clang) and embedded in the gpu package; the
// test driver (testdata/fakecuda) compiles it for the host.
#include "troupe_kernel.h"

typedef struct {
	unsigned long long *ctl;
	unsigned long long idle_ns;
	unsigned long long gen;
} AgentArgs;

// troupe_copy_agent polls a control block in pinned host memory mapped for
// the device and copies what it is asked to with the threads of its one
// block, so that a small copy costs the device's reads and writes across
// PCIe, not a copy-engine operation and a stream synchronize.
//
// Control block, 8-byte words: job k is posted in words 0..2 (destination,
// source, length), each tagged with 1 + k mod 65535 in its top 16 bits (never 0), so one
// read of the three tells whether they all belong to job k, whatever order
// the host's stores reach the device in; word 3 nonzero asks the agent to
// return; word 8 (its own cache line) is the number of the last finished
// job; word 16 (another line) holds gen while the agent runs and 0 once it
// has decided to return. The agent returns when asked or after idle_ns
// without a job.
TROUPE_KERNEL(troupe_copy_agent, AgentArgs, p) {
	TROUPE_SHARED unsigned long long word[4];
	TROUPE_SHARED unsigned long long cmd, dst, src, len;
	const unsigned long long low48 = (1ull << 48) - 1;
	volatile unsigned long long *ctl = (volatile unsigned long long *)p.ctl;
	unsigned tid = threadIdx.x, nt = blockDim.x;
	if (TROUPE_SEQUENTIAL) {
		if (tid != 0)
			return;
		nt = 1;
	}
	unsigned long long next = ctl[8] + 1;
	unsigned long long since = troupe_clock_ns();
	if (tid == 0)
		ctl[16] = p.gen;
	for (;;) {
		for (unsigned i = tid; i < 4; i += nt)
			word[i] = ctl[i];
		troupe_sync_block();
		if (tid == 0) {
			unsigned long long tag = (next % 0xffff + 1) << 48;
			if ((word[0] & ~low48) == tag && (word[1] & ~low48) == tag && (word[2] & ~low48) == tag) {
				cmd = 1;
				dst = word[0] & low48;
				src = word[1] & low48;
				len = word[2] & low48;
			} else if (word[3] != 0 || troupe_clock_ns() - since > p.idle_ns) {
				cmd = 2;
				ctl[16] = 0;
			} else {
				cmd = 0;
			}
		}
		troupe_sync_block();
		unsigned long long c = cmd;
		if (c == 2)
			return;
		if (c == 1) {
			long long n = (long long)len;
			if (((dst | src | len) & 7) == 0) {
				volatile unsigned long long *d = (volatile unsigned long long *)dst;
				volatile unsigned long long *s = (volatile unsigned long long *)src;
				for (long long i = tid; i < n / 8; i += nt)
					d[i] = s[i];
			} else {
				volatile unsigned char *d = (volatile unsigned char *)dst;
				volatile unsigned char *s = (volatile unsigned char *)src;
				for (long long i = tid; i < n; i += nt)
					d[i] = s[i];
			}
			troupe_fence_system();
		}
		troupe_sync_block();
		if (c == 1) {
			if (tid == 0)
				ctl[8] = next;
			next++;
			since = troupe_clock_ns();
		}
	}
}
