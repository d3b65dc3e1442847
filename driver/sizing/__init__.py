"""Right-sizing GPU claims from what workloads really use (pure): a compact usage history per claim,
the sizes a claim can have and their ladders, recommendations per workload, and patches to a
claim template. The node plugin's sampling, the webhook's Initial mode and `fgpu rightsize` build
on it (docs/rightsizing.md)."""
