"""OpenAI's audio routes (/v1/audio/transcriptions, /translations) on a Whisper checkpoint."""
