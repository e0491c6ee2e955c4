package overlap

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestCalibrate(t *testing.T) {
	// Exact line: 0.08 ns/B + 2us.
	var exact []Sample
	for _, size := range []int64{8 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20} {
		exact = append(exact, Sample{Size: size, Time: time.Duration(0.08*float64(size)) + 2*time.Microsecond})
	}
	cases := []struct {
		name      string
		samples   []Sample
		wantErr   error
		alpha     float64
		beta      time.Duration
		clamped   bool
		minR2     float64
		tolAlpha  float64
		tolBetaNs float64
	}{
		{name: "exact", samples: exact, alpha: 0.08, beta: 2 * time.Microsecond, minR2: 0.999999, tolAlpha: 1e-6, tolBetaNs: 2},
		{
			name: "noisy, repeated sizes",
			samples: []Sample{
				{1 << 20, 84 * time.Microsecond}, {1 << 20, 86 * time.Microsecond},
				{2 << 20, 170 * time.Microsecond}, {2 << 20, 168 * time.Microsecond},
				{4 << 20, 338 * time.Microsecond}, {4 << 20, 337 * time.Microsecond},
			},
			alpha: 0.0802, beta: 1 * time.Microsecond, minR2: 0.99, tolAlpha: 0.001, tolBetaNs: 1000,
		},
		{
			name:    "negative intercept clamped",
			samples: []Sample{{1000, 1 * time.Nanosecond}, {2000, 1000 * time.Nanosecond}},
			alpha:   0.999, beta: 0, clamped: true, minR2: 1, tolAlpha: 1e-9,
		},
		{name: "empty", samples: nil, wantErr: ErrTooFewSamples},
		{name: "one sample", samples: exact[:1], wantErr: ErrTooFewSamples},
		{name: "negative size", samples: []Sample{{-1, 1}, {2, 2}}, wantErr: ErrBadSample},
		{name: "zero time", samples: []Sample{{1, 0}, {2, 2}}, wantErr: ErrBadSample},
		{name: "negative time", samples: []Sample{{1, 5}, {2, -2}}, wantErr: ErrBadSample},
		{name: "one distinct size", samples: []Sample{{64, 5}, {64, 7}}, wantErr: ErrDegenerate},
		{
			// As floats these sizes' mean rounds, and their deviations
			// from it were not all 0: a fit of one size was accepted.
			name:    "one distinct size, huge",
			samples: []Sample{{282993306652397236, 360}, {282993306652397236, 721}, {282993306652397236, 784}},
			wantErr: ErrDegenerate,
		},
		{
			// An intercept of 2^63 ns became a negative Beta.
			name:    "intercept beyond a Duration",
			samples: []Sample{{0, math.MaxInt64 - 1024}, {1, math.MaxInt64}},
			wantErr: ErrBadFit,
		},
		{name: "time falls with size", samples: []Sample{{64, 50}, {128, 20}}, wantErr: ErrBadFit},
		{name: "flat", samples: []Sample{{64, 50}, {128, 50}}, wantErr: ErrBadFit},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f, err := Calibrate(tc.samples)
			if tc.wantErr != nil {
				require.ErrorIs(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.InDelta(t, tc.alpha, f.Alpha, tc.tolAlpha)
			require.InDelta(t, float64(tc.beta), float64(f.Beta), tc.tolBetaNs)
			require.Equal(t, tc.clamped, f.BetaClamped)
			require.GreaterOrEqual(t, f.R2, tc.minR2)
			c := f.Apply(DefaultConfig())
			require.Equal(t, f.Alpha, c.Alpha)
			require.Equal(t, f.Beta, c.Beta)
			require.NoError(t, c.Validate())
		})
	}
}
