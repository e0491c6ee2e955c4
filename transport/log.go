package transport

import (
	"os"
	"strings"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// EnvLog names the variable that sets the log level of ranks and the
// launcher: debug, info, warn (the default) or error.
const EnvLog = "TROUPE_LOG"

// LoggerFromEnv returns a zap logger writing to standard error at the level
// named by TROUPE_LOG (warn when unset or unknown): quiet by default.
func LoggerFromEnv() *zap.Logger {
	level := zapcore.WarnLevel
	if v := strings.TrimSpace(os.Getenv(EnvLog)); v != "" {
		if l, err := zapcore.ParseLevel(v); err == nil {
			level = l
		}
	}
	cfg := zap.NewDevelopmentEncoderConfig()
	core := zapcore.NewCore(zapcore.NewConsoleEncoder(cfg), zapcore.Lock(os.Stderr), level)
	return zap.New(core)
}
