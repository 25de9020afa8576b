"""Prototype for issue 24 item 3: can stage 3 gather a unit's parameters in one collective while every
parameter is still read at its own site (the any-Cell property design)? Two weights of one unit, 2 ranks, CPU,
graph mode; the executed graph's collectives are counted in MindSpore's saved IR, the gradients saved per rank.

Variants (argv[1]):
  separate  one all-gather per read (today): 2 AllGather, 2 AllReduce of 4096
  fused     every read site calls the same fused gather of the concatenated shards and slices its part:
            graph-mode CSE merges the identical gathers (1 AllGather), but autodiff ran before CSE, so each site
            keeps its own backward: 2 AllReduce of the whole unit (8192): twice the bytes
  port      the fused gather stop_gradient'ed; each site's gradient enters through its own port (the shard tiled
            under InsertGradientOf, reduced exactly: the quantized gather's trick): 1 AllGather, 2 AllReduce of
            4096; gradients bit-identical to `separate`

Run: msrun --worker_num=2 --local_worker_num=2 --master_port=PORT --log_dir=DIR --join=True \
     benchmarks/fused_gather_proto.py {separate,fused,port}   (rank 0's log prints the counts)
"""
import glob, os, sys, numpy as np, mindspore as ms
from mindspore import ops, nn, Tensor, Parameter
from mindspore.communication import init, get_rank, get_group_size
from mindspore.ops._grad_experimental.grad_base import bprop_getters
variant = sys.argv[1]
out = os.environ.get("PROTO_OUT", "/tmp/fused_gather_proto")
path = f"{out}/ir_{variant}"
ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", save_graphs=1, save_graphs_path=path)
init()
rank, n = get_rank(), get_group_size()

class G(ops.AllGather):
    substitute_name = "AllGather"

def make(size, tag):
    op = G()
    op.add_prim_attr("proto_tag", tag)
    red = ops.AllReduce()
    def bprop(x, out, dout):
        return (red(dout).reshape((n, -1))[rank],)
    op.zb = bprop
    return op

@bprop_getters.register(G)
def _g(self):
    return self.zb

D = 64
rng = np.random.default_rng(0)
w1 = rng.standard_normal(D * D).astype(np.float32)
w2 = rng.standard_normal(D * D).astype(np.float32)
h = D * D // n
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.s1 = Parameter(Tensor(w1[rank * h:(rank + 1) * h]), name="s1")
        self.s2 = Parameter(Tensor(w2[rank * h:(rank + 1) * h]), name="s2")
        self.g1, self.g2, self.gf = make(h, "a"), make(h, "b"), make(2 * h, "f")
        red = ops.AllReduce()
        def transform(dout):
            total = red(dout.reshape((-1,))).reshape((n, -1))[rank].reshape((1, -1))
            return ops.concat((total, ops.zeros((n - 1, h), ms.float32)))
        self.ins = ops.InsertGradientOf(transform)
        self.ins2 = ops.InsertGradientOf(transform)
        self.ins2.add_prim_attr("proto_tag", "second")
    def fused(self):
        return self.gf(ops.concat((self.s1, self.s2))).reshape((n, 2, h))
    def read(self, k, shard, gather, ins):
        """Weight k (0 or 1) as the variant reads it; ``gather``/``ins``: its own gather and port."""
        if variant == "separate":
            return gather(shard).reshape((D, D))
        part = self.fused()[:, k]
        if variant == "port":
            port = ins(ops.tile(shard.reshape((1, -1)), (n, 1)))
            part = ops.stop_gradient(part) + (port - ops.stop_gradient(port))
        return part.reshape((D, D))
    def construct(self, x):
        w1, w2 = self.read(0, self.s1, self.g1, self.ins), self.read(1, self.s2, self.g2, self.ins2)
        y = ops.matmul(ops.tanh(ops.matmul(x, w1)), w2)
        return (y * y).mean()
net = Net()
grad = ms.value_and_grad(net, None, net.trainable_params())
x = Tensor(np.random.default_rng(1 + rank).standard_normal((8, D)).astype(np.float32))
loss, (g1, g2) = grad(x)
np.save(f"{out}/grads_{variant}_{rank}.npy", np.concatenate([g1.asnumpy(), g2.asnumpy()]))
if rank == 0:
    import re
    files = sorted(glob.glob(f"{path}/**/*execute*.ir", recursive=True), key=os.path.getmtime)
    text = open(files[-1]).read()
    reduces = re.findall(r"= AllReduce\(.*\n.*\n?.*?: \(<Tensor\[Float32\], \((\d+)\)>\) ->", text)
    print(variant, os.path.basename(files[-1]), "AllGather:", len(re.findall(r"= AllGather\(", text)), "AllReduce sizes:", reduces,
          "loss", float(loss.asnumpy()))
    reference = f"{out}/grads_separate_{rank}.npy"
    if variant != "separate" and os.path.exists(reference):
        mine = np.load(f"{out}/grads_{variant}_{rank}.npy")
        print(variant, "gradients bit-identical to separate:", bool(np.array_equal(mine, np.load(reference))))
