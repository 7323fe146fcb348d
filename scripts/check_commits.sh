#!/usr/bin/env bash
# Commit subjects of at most 72 characters, for every commit since the rule was adopted (older history
# is left as it is). Skipped, saying so, where the checkout has no history to read (a shallow clone).
set -euo pipefail
cd "$(dirname "$0")/.."
SINCE=de3aa1f  # the first commits of the layout change, before the rule was checked
if ! git rev-parse -q --verify "$SINCE^{commit}" >/dev/null 2>&1; then
    echo "commit subjects: skipped (no history back to $SINCE in this checkout)"
    exit 0
fi
bad=$(git log --format='%h %s' "$SINCE..HEAD" | awk '{ s = substr($0, index($0, " ") + 1); if (length(s) > 72) print }')
if [ -n "$bad" ]; then
    echo "commit subjects over 72 characters:" >&2
    echo "$bad" >&2
    exit 1
fi
echo "commit subjects: $(git rev-list --count "$SINCE..HEAD") checked, all at most 72 characters"
