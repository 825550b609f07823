# The gdfold_max kernels, packaged for MAX's custom-op loader.
