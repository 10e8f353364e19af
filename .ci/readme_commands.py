"""Prints the README's commands that CI runs, one a line: each ```sh block after a line
`<!-- CI runs this command as written -->`. With --latest, without `-c constraints.txt`."""

import re
import sys

MARK = "<!-- CI runs this command as written -->"

with open("README.md", encoding="utf-8") as f:
  text = f.read()
commands = [line.strip()
            for block in re.findall(re.escape(MARK) + r"\n```sh\n(.*?)```", text, re.S)
            for line in block.splitlines() if line.strip()]
if len(commands) != text.count(MARK):
  sys.exit(f"README.md: {text.count(MARK)} marks but {len(commands)} commands under them")
for command in commands:
  print(command.replace(" -c constraints.txt", "") if "--latest" in sys.argv else command)
