package delayq.fs;

import java.io.ByteArrayOutputStream;
import java.io.FileNotFoundException;
import java.io.IOException;
import java.io.InputStream;
import java.nio.ByteBuffer;
import java.nio.channels.FileChannel;
import java.nio.charset.StandardCharsets;
import java.nio.file.FileAlreadyExistsException;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.StandardCopyOption;
import java.nio.file.StandardOpenOption;
import java.util.Arrays;
import java.util.Iterator;
import java.util.UUID;

import io.delta.storage.HadoopFileSystemLogStore;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.LocalFileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * A Delta LogStore for file: paths (a local disk, or a shared filesystem mounted everywhere)
 * that is safe with several writers: a commit file {@code _delta_log/N.json} is created
 * put-if-absent with a hard link, as the engine's own driver-side commits are
 * (engine/lakehouse/storage/store.py, {@code LocalStore.create}).
 *
 * <p>Delta 4.4's default for file:, HDFSLogStore, checks that {@code N.json} is absent and then
 * renames its temporary file over it: a writer that creates {@code N.json} between the check and
 * the rename (the engine's log appender, another Spark application) has its commit replaced, its
 * rows and its {@code txn} gone, while it believes it committed. (Hadoop's rename checks once
 * more just before it renames: the window is narrow, microseconds, but open.) Here the content is
 * written whole to a temporary file beside the commit and flushed, then linked to the commit's
 * name: the link fails if the name exists, so of two writers of one version exactly one wins,
 * and the other gets {@link FileAlreadyExistsException}, on which Delta re-reads the log, checks
 * for conflicts and retries at the next version. A reader sees the file whole or not at all.
 *
 * <p>Enable: {@code spark.delta.logStore.file.impl=delayq.fs.LinkLogStore}. The filesystem must
 * make hard links (any local Linux filesystem, NFS); one that cannot fails the commit, saying so.
 */
public class LinkLogStore extends HadoopFileSystemLogStore {
  private static final Logger LOG = LoggerFactory.getLogger(LinkLogStore.class);

  public LinkLogStore(Configuration initHadoopConf) {
    super(initHadoopConf);
  }

  @Override
  public void write(Path path, Iterator<String> actions, Boolean overwrite, Configuration hadoopConf)
      throws IOException {
    // Serialise first: nothing is written until the whole content is known.
    byte[] body = serialise(actions);
    java.nio.file.Path target = localFile(path, hadoopConf);
    java.nio.file.Path folder = target.toAbsolutePath().getParent();
    if (!Files.isDirectory(folder)) {
      // As HadoopFileSystemLogStore: Delta makes _delta_log itself before the first commit.
      throw new FileNotFoundException("No such file or directory: " + path.getParent());
    }
    // Hidden and not named like a version: Delta, delta-rs and the log appender skip it.
    java.nio.file.Path temp =
        folder.resolve("." + target.getFileName() + "." + UUID.randomUUID() + ".tmp");
    try {
      writeDurably(temp, body);
      // Before the name appears: a reader must never find the new file beside a checksum
      // of an earlier one. (If another writer wins the name, its checksum goes: a file
      // without one is read unchecked, which is how every other commit here is read.)
      removeStaleChecksum(target);
      if (overwrite) {
        // _last_checkpoint and the like: replaced in one rename, never seen half written.
        Files.move(
            temp, target, StandardCopyOption.ATOMIC_MOVE, StandardCopyOption.REPLACE_EXISTING);
      } else {
        link(path, target, temp, body);
      }
      syncFolder(folder);
    } finally {
      try {
        Files.deleteIfExists(temp);   // after a link the commit keeps the content
      } catch (IOException e) {
        LOG.warn("could not delete the temporary file {}", temp, e);
      }
    }
  }

  /** Whether Delta must write its checkpoint files (written by Spark's Parquet writer, not by
   *  this store) elsewhere and rename them into place: yes, a local file is visible while it
   *  is written. (It also makes Delta serialise the commits of one JVM's threads to one table,
   *  as with HDFSLogStore: the link is what keeps other processes' commits apart.) */
  @Override
  public Boolean isPartialWriteVisible(Path path, Configuration hadoopConf) {
    return true;
  }

  /** Create {@code target} as a hard link to the complete {@code temp}, unless it exists. */
  private static void link(
      Path path, java.nio.file.Path target, java.nio.file.Path temp, byte[] body)
      throws IOException {
    try {
      Files.createLink(target, temp);
    } catch (FileAlreadyExistsException e) {
      if (ours(target, temp, body)) {
        // A link retried after its answer was lost (NFS) finds the file it made.
        LOG.warn("{} already holds exactly this commit: counting it as ours", path);
        return;
      }
      LOG.info("{} was committed by another writer first", path);
      FileAlreadyExistsException lost = new FileAlreadyExistsException(path.toString());
      lost.initCause(e);
      throw lost;
    } catch (IOException | UnsupportedOperationException e) {
      // The link may have landed although its answer failed (an NFS timeout, EIO): then the
      // commit is ours, and reporting a failure would have a retry without txn append twice.
      try {
        if (Files.isSameFile(target, temp)) {
          LOG.warn("linking {} failed ({}) but the commit is there: counting it as ours", path, e);
          return;
        }
      } catch (IOException ignored) {
        // no such file: the link did not land
      }
      if (e instanceof UnsupportedOperationException || isNoLinks(e)) {
        throw new IOException("could not link " + path + " (" + e + "): delayq.fs.LinkLogStore "
            + "needs a filesystem with hard links (with one writer only, spark.delta.logStore."
            + "file.impl=io.delta.storage.HDFSLogStore will do)", e);
      }
      throw (IOException) e;
    }
  }

  /** EPERM, EOPNOTSUPP or EXDEV: a filesystem that makes no hard links here. */
  private static boolean isNoLinks(Exception e) {
    String text = String.valueOf(e.getMessage());
    return e instanceof java.nio.file.AccessDeniedException
        || text.contains("Operation not permitted")
        || text.contains("Operation not supported")
        || text.contains("Invalid cross-device link");
  }

  /** The existing commit is this write's own: the same file, or exactly the same bytes of a
   *  commit that names its transaction ({@code commitInfo.txnId}, a UUID Delta gives each
   *  transaction): two transactions' commits can be byte for byte alike only without one. */
  private static boolean ours(java.nio.file.Path target, java.nio.file.Path temp, byte[] body) {
    try {
      if (Files.isSameFile(target, temp)) {
        return true;
      }
      if (!namesItsTransaction(body)) {
        return false;
      }
      try (InputStream in = Files.newInputStream(target)) {
        return Arrays.equals(readAll(in, body.length + 1), body);
      }
    } catch (NoSuchFileException e) {
      return false;   // cleaned up meanwhile: certainly not ours
    } catch (IOException e) {
      LOG.warn("could not read {} back", target, e);
      return false;
    }
  }

  /** Whether the commit's {@code commitInfo} carries a {@code txnId}. */
  static boolean namesItsTransaction(byte[] body) {
    String text = new String(body, StandardCharsets.UTF_8);
    for (String line : text.split("\n")) {
      if (line.startsWith("{\"commitInfo\"") && line.matches(".*\"txnId\"\\s*:\\s*\"[^\"]+\".*")) {
        return true;
      }
    }
    return false;
  }

  private static void writeDurably(java.nio.file.Path temp, byte[] body) throws IOException {
    try (FileChannel out =
        FileChannel.open(temp, StandardOpenOption.CREATE_NEW, StandardOpenOption.WRITE)) {
      ByteBuffer buf = ByteBuffer.wrap(body);
      while (buf.hasRemaining()) {
        out.write(buf);
      }
      // Before the link: a crash must not leave a commit whose name exists but whose
      // content never reached the disk (a link, unlike a rename over a file, is not ordered
      // after the data by ext4's delayed allocation).
      out.force(true);
    }
  }

  /** Make the new name durable too; best effort (not every platform can sync a folder). */
  private static void syncFolder(java.nio.file.Path folder) {
    try (FileChannel dir = FileChannel.open(folder, StandardOpenOption.READ)) {
      dir.force(true);
    } catch (IOException e) {
      LOG.debug("could not sync the folder {}", folder, e);
    }
  }

  /** Hadoop's checksummed local filesystem verifies a file against {@code .NAME.crc} when it
   *  reads it: one left by an earlier writer of this name would fail every read of ours. */
  private static void removeStaleChecksum(java.nio.file.Path target) {
    java.nio.file.Path crc = target.resolveSibling("." + target.getFileName() + ".crc");
    try {
      Files.deleteIfExists(crc);
    } catch (IOException e) {
      LOG.warn("could not delete {}", crc, e);
    }
  }

  private static java.nio.file.Path localFile(Path path, Configuration hadoopConf)
      throws IOException {
    FileSystem fs = path.getFileSystem(hadoopConf);
    if (fs instanceof LocalFileSystem) {
      return ((LocalFileSystem) fs).pathToFile(path).toPath();
    }
    if (fs instanceof RawLocalFileSystem) {
      return ((RawLocalFileSystem) fs).pathToFile(path).toPath();
    }
    throw new IOException(path + " is on " + fs.getUri() + ", not a local filesystem: "
        + "delayq.fs.LinkLogStore is for file: paths (spark.delta.logStore.file.impl)");
  }

  private static byte[] serialise(Iterator<String> actions) {
    StringBuilder sb = new StringBuilder();
    while (actions.hasNext()) {
      sb.append(actions.next()).append('\n');
    }
    return sb.toString().getBytes(StandardCharsets.UTF_8);
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
