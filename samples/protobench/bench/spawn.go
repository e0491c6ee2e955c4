package bench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"text/tabwriter"
	"time"
)

// ReadyPrefix starts the line a server process prints on stdout once it
// listens; the rest of the line is its address. SpawnServer waits for it.
const ReadyPrefix = "protobench-server listening on "

// Child is a server running in a child process.
type Child struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	addr  string
	done  chan error
}

// SpawnServer starts cmd, a server process that prints a ReadyPrefix line
// and exits when its stdin reaches end of file (protobench -role server
// -stdin-eof), and waits up to timeout for the ready line. The child's
// stderr goes to this process's stderr unless cmd.Stderr is set.
func SpawnServer(cmd *exec.Cmd, timeout time.Duration) (*Child, error) {
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("spawn protobench server: stdin pipe: %w", err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("spawn protobench server: stdout pipe: %w", err)
	}
	if cmd.Stderr == nil {
		cmd.Stderr = os.Stderr
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("spawn protobench server %s: %w", cmd.Path, err)
	}
	c := &Child{cmd: cmd, stdin: stdin, done: make(chan error, 1)}

	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		sent := false
		for sc.Scan() {
			line := sc.Text()
			if !sent && strings.HasPrefix(line, ReadyPrefix) {
				ready <- strings.TrimSpace(strings.TrimPrefix(line, ReadyPrefix))
				sent = true
				continue
			}
			fmt.Fprintln(os.Stderr, "protobench server:", line)
		}
		if !sent {
			close(ready)
		}
		c.done <- cmd.Wait()
	}()

	select {
	case addr, ok := <-ready:
		if !ok {
			err := <-c.done
			return nil, fmt.Errorf("protobench server exited before listening: %v", err)
		}
		c.addr = addr
		return c, nil
	case <-time.After(timeout):
		c.kill()
		return nil, fmt.Errorf("protobench server did not report its address within %v", timeout)
	}
}

// Addr is the address the child server listens on.
func (c *Child) Addr() string { return c.addr }

// Stop closes the child's stdin, which makes it exit, and waits for it; it
// kills the child if it has not exited after five seconds.
func (c *Child) Stop() error {
	c.stdin.Close()
	select {
	case err := <-c.done:
		if err != nil {
			return fmt.Errorf("protobench server: %w", err)
		}
		return nil
	case <-time.After(5 * time.Second):
		c.kill()
		return fmt.Errorf("protobench server did not exit on stdin EOF; killed")
	}
}

func (c *Child) kill() {
	c.stdin.Close()
	if c.cmd.Process != nil {
		c.cmd.Process.Kill()
	}
	<-c.done
}

// WriteJSON writes one JSON object per row.
func WriteJSON(w io.Writer, rows []Row) error {
	enc := json.NewEncoder(w)
	for _, r := range rows {
		if err := enc.Encode(r); err != nil {
			return fmt.Errorf("write json row: %w", err)
		}
	}
	return nil
}

// WriteTable writes rows as an aligned text table.
func WriteTable(w io.Writer, rows []Row) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "impl\ttest\tsize(B)\tcount\tmean(us)\tmedian(us)\tmsgs/s\tMB/s\t")
	for _, r := range rows {
		switch r.Test {
		case "rtt":
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%.1f\t%.1f\t-\t-\t\n", r.Impl, r.Test, r.Size, r.Count, r.US, r.MedianUS)
		default:
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t-\t-\t%.0f\t%.1f\t\n", r.Impl, r.Test, r.Size, r.Count, r.MsgsPerS, r.MBps)
		}
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("write table: %w", err)
	}
	return nil
}
