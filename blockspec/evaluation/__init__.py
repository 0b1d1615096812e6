"""Drafter evaluation: `blockspec eval-draft` (acceptance and speed on the shipped evaluation prompt sets)."""
