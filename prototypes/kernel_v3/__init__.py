"""The decode kernel v3 prototype (not part of the installed package): a fragment-ordered pack layout,
folded scales and Hopper (sm_90a) CUDA experiments at 16 heads. See README.md beside this file."""
