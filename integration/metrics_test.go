package integration

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/troupe-hpc/troupe/actor"
	"github.com/troupe-hpc/troupe/transport/metrics"
)

func init() { scenarios["actor-metrics"] = actorMetrics }

// metricsPings is how many requests rank 0 makes of rank 1's echo.
const metricsPings = 25

// TestActorMetrics: every rank of a real job serves its metrics because
// TROUPE_METRICS_ADDR is in its environment (port 0: one of the system's
// choosing each), and each rank reads the other's counters over HTTP after
// rank 0 has made metricsPings requests of rank 1.
func TestActorMetrics(t *testing.T) {
	t.Setenv(metrics.AddrEnv, "127.0.0.1:0")
	forActorTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "actor-metrics", 2, c)
		requireLine(t, res, "[0] rank 0: rank 1's metrics count the requests")
		requireLine(t, res, "[1] rank 1: rank 0's metrics count the requests")
	})
}

func actorMetrics(ctx context.Context, r *rank) error {
	return withActors(ctx, r, actor.Options{}, func(rt *actor.Runtime) error {
		if rt.MetricsURL() == "" {
			return fmt.Errorf("no metrics endpoint with %s=%q", metrics.AddrEnv, "127.0.0.1:0")
		}
		if _, err := spawn(rt, "echo", echo(rt)); err != nil {
			return err
		}
		if err := r.b.Barrier(ctx, "metrics.spawned"); err != nil {
			return err
		}
		if rt.Rank() == 0 {
			for i := range metricsPings {
				if err := ping(rt, 1, i); err != nil {
					return err
				}
			}
		}
		urls, err := r.b.AllGather(ctx, "metrics.urls", []byte(rt.MetricsURL()))
		if err != nil {
			return err
		}
		peer := 1 - rt.Rank()
		body, err := fetch(ctx, string(urls[peer]))
		if err != nil {
			return err
		}
		// Rank 0 sent the requests and received the answers; rank 1 the
		// other way round: metricsPings actor messages each way.
		for _, name := range []string{"troupe_actor_sent_total", "troupe_actor_received_total"} {
			v, err := sample(body, name, peer)
			if err != nil {
				return err
			}
			if v != metricsPings {
				return fmt.Errorf("rank %d's %s = %v, want %d", peer, name, v, metricsPings)
			}
		}
		if v, err := sample(body, "troupe_traffic_am_received_total", peer); err != nil || v < metricsPings {
			return fmt.Errorf("rank %d's active messages received: %v, %v; want at least %d", peer, v, err, metricsPings)
		}
		r.logf("rank %d's metrics count the requests", peer)
		// Nobody stops serving while the other still reads.
		return r.b.Barrier(ctx, "metrics.read")
	})
}

// fetch GETs url.
func fetch(ctx context.Context, url string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return string(b), nil
}

// sample returns the value of name's series for rank in a text exposition.
func sample(body, name string, rank int) (float64, error) {
	prefix := fmt.Sprintf("%s{rank=%q} ", name, strconv.Itoa(rank))
	for _, l := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(l, prefix); ok {
			return strconv.ParseFloat(v, 64)
		}
	}
	return 0, fmt.Errorf("no %s for rank %d in the metrics", name, rank)
}
