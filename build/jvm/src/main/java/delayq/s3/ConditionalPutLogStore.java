package delayq.s3;

import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.lang.reflect.Method;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.Iterator;

import io.delta.storage.HadoopFileSystemLogStore;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FSDataInputStream;
import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * A Delta LogStore for s3a:// that is safe with several writers (processes, machines): a commit
 * file {@code _delta_log/N.json} is created with S3's conditional PUT ({@code If-None-Match: *}),
 * through Hadoop 3.4.2+/3.5's S3A option {@code fs.option.create.conditional.overwrite}. Of two
 * writers of one version exactly one wins; the other gets 412 and this store throws
 * {@link java.nio.file.FileAlreadyExistsException}, on which Delta re-reads the log, checks for
 * conflicts and retries at the next version.
 *
 * <p>Needs {@code fs.s3a.create.conditional.enabled=true} (the default) and a store that honours
 * If-None-Match (AWS S3 since 2024-08, S3Proxy 4.x, MinIO, ...). A PUT is atomic, so a reader never
 * sees a partial commit: {@link #isPartialWriteVisible} is false, and Delta writes checkpoints in
 * place (no rename).
 *
 * <p>Enable: {@code spark.delta.logStore.s3a.impl=delayq.s3.ConditionalPutLogStore}.
 */
public class ConditionalPutLogStore extends HadoopFileSystemLogStore {
  private static final Logger LOG = LoggerFactory.getLogger(ConditionalPutLogStore.class);

  /** Hadoop's builder option for create-only-if-absent (Options.CreateFileOptionKeys). */
  public static final String CONDITIONAL_OVERWRITE = "fs.option.create.conditional.overwrite";

  public ConditionalPutLogStore(Configuration initHadoopConf) {
    super(initHadoopConf);
  }

  @Override
  public void write(Path path, Iterator<String> actions, Boolean overwrite, Configuration hadoopConf)
      throws IOException {
    // Serialise first: nothing is sent until the whole content is known, so a failure while
    // producing the actions can never leave a partial object behind.
    byte[] body = serialise(actions);
    FileSystem fs = path.getFileSystem(hadoopConf);
    if (overwrite) {
      try (FSDataOutputStream out = fs.create(path, true)) {
        out.write(body);
      }
      return;
    }
    FSDataOutputStream out = null;
    boolean closed = false;
    try {
      // S3A may already find the file while building the stream (FileAlreadyExistsException)
      out = (FSDataOutputStream) fs.createFile(path)
          .overwrite(false)
          .recursive()
          .must(CONDITIONAL_OVERWRITE, true)
          .build();
      out.write(body);
      closed = true;   // close() runs the PUT (If-None-Match: *); on failure nothing is stored
      out.close();
    } catch (IOException e) {
      if (out != null && !closed) {
        out.abort();   // never upload a partial object
      }
      if (isAlreadyExists(e)) {
        if (sameContent(fs, path, body)) {
          // Our own PUT reached the store but its answer was lost, and the retry got 412.
          LOG.warn("{} already holds exactly this commit: counting it as ours", path);
          return;
        }
        LOG.info("conditional PUT of {} lost the race (412): another writer committed it", path);
        java.nio.file.FileAlreadyExistsException fae =
            new java.nio.file.FileAlreadyExistsException(path.toString());
        fae.initCause(e);
        throw fae;
      }
      throw e;
    }
  }

  @Override
  public Boolean isPartialWriteVisible(Path path, Configuration hadoopConf) {
    return false;
  }

  private static byte[] serialise(Iterator<String> actions) {
    StringBuilder sb = new StringBuilder();
    while (actions.hasNext()) {
      sb.append(actions.next()).append('\n');
    }
    return sb.toString().getBytes(StandardCharsets.UTF_8);
  }

  /** 412 Precondition Failed (S3A: RemoteFileChangedException), 409 ConditionalRequestConflict
   *  (AWS S3 when two conditional PUTs of one key overlap), or Hadoop's FileAlreadyExistsException. */
  static boolean isAlreadyExists(Throwable e) {
    for (Throwable t = e; t != null; t = t.getCause()) {
      String name = t.getClass().getName();
      if (name.equals("org.apache.hadoop.fs.s3a.RemoteFileChangedException")
          || name.equals("org.apache.hadoop.fs.FileAlreadyExistsException")) {
        return true;
      }
      Integer status = statusCode(t);
      if (status != null && (status == 412 || status == 409)) {
        return true;
      }
      if (t.getCause() == t) {
        break;
      }
    }
    return false;
  }

  /** statusCode() of an AWS SDK v2 service exception, by reflection (no compile-time SDK dep). */
  private static Integer statusCode(Throwable t) {
    try {
      Method m = t.getClass().getMethod("statusCode");
      Object v = m.invoke(t);
      return v instanceof Integer ? (Integer) v : null;
    } catch (ReflectiveOperationException | RuntimeException ignored) {
      return null;
    }
  }

  private static boolean sameContent(FileSystem fs, Path path, byte[] body) {
    try (FSDataInputStream in = fs.open(path)) {
      return Arrays.equals(readAll(in, body.length + 1), body);
    } catch (IOException e) {
      return false;
    }
  }

  private static byte[] readAll(InputStream in, int limit) throws IOException {
    ByteArrayOutputStream buf = new ByteArrayOutputStream();
    byte[] chunk = new byte[8192];
    int n;
    while (buf.size() <= limit && (n = in.read(chunk)) > 0) {
      buf.write(chunk, 0, n);
    }
    return buf.toByteArray();
  }
}
