#!/usr/bin/env bash
# Prints the results folder name of this machine's first GPU (h100, h200, ...), or cpu.
name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case $name in
  *H100*) echo h100 ;;
  *H200*) echo h200 ;;
  "") echo cpu ;;
  *) echo "$name" | tr 'A-Z ' 'a-z_' ;;
esac
